"""Static analyses of a graph that allocate no weights: parameters (params.py), model structure
(structure.py), exact symbolic costs (cost.py over poly.py), memory (memory.py), roofline
estimates (roofline.py) and the report that gathers them (costreport.py; attention_report.py and
quant_report.py describe what the passes did, which compiler/report.py runs on a copy)."""
