"""Patterns over the IR that more than one part of the compiler must agree on.

They live beside ir/ rather than in passes/ or analysis/ because both use them:
the fusion pass and the kernel choice rewrite what a pattern matched, and the
report's structure analysis reasons about the same matches. One recogniser means
``--explain`` and the report can never disagree about what is attention.

matcher.py is the small matcher most of them are written on (patterns as data, a failed match
keeping its reason and node); attention.py keeps its own table of score-path rules.
"""
