"""Greedy generation in onnxruntime-genai, for tests/generation/test_genai.py: run with a Python that has
onnxruntime-genai installed (TESSERA_GENAI_PYTHON), never imported by the tests themselves.

    python genai_runner.py FOLDER REQUEST.json   ->  prints a JSON result on stdout

REQUEST: {"runs": [{"prompts": [[ids], ...], "max_length": N}, ...], "texts": ["...", ...]}.
Each run is one og.Generator over its prompts (a batch when there are several; they are passed
as given, so a batch must be of equal lengths), decoding greedily to ``max_length`` tokens per
row or the config's end-of-sequence token; the result holds each row's new tokens. ``texts`` are
encoded with the folder's tokenizer (og.Tokenizer) and decoded back.
"""

import json
import sys

import numpy as np
import onnxruntime_genai as og


def main(folder: str, request: str) -> None:
    req = json.loads(open(request, encoding="utf-8").read())
    model = og.Model(folder)
    result = {"runs": [], "texts": []}
    for run in req["runs"]:
        prompts = np.array(run["prompts"], dtype=np.int32)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=run["max_length"], do_sample=False, batch_size=len(prompts))
        gen = og.Generator(model, params)
        gen.append_tokens(prompts)
        while not gen.is_done():
            gen.generate_next_token()
        rows = [gen.get_sequence(i).tolist()[prompts.shape[1]:] for i in range(len(prompts))]
        result["runs"].append(rows)
    if req.get("texts"):
        tok = og.Tokenizer(model)
        for text in req["texts"]:
            ids = tok.encode(text).tolist()
            result["texts"].append({"ids": ids, "decoded": tok.decode(np.array(ids, dtype=np.int32))})
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
