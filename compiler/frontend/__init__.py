"""From a parsed spec to the IR: elaboration (elaborate.py) of blocks, loops and expressions
into graph nodes, the builtins a spec can call (builtins.py) and compile-time values (values.py)."""
