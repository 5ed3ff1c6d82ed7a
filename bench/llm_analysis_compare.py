"""The deployment figures of ``tessera report`` beside llm-analysis 0.2.2's, on configurations both can describe.

    pip install llm-analysis==0.2.2     # not a dependency of tessera; it pins transformers<5, so
                                        # reinstall the project's transformers afterwards
    python bench/llm_analysis_compare.py

Prints the Markdown table of docs/report.md ("Against llm-analysis 0.2.2"): GPT-3 training at
T = 8, P = 8, D = 4, ZeRO-1, micro-batch 1, N = 2048, fp16, for each recomputation, and GPT-3
inference (T = 8) at N = 2048. llm-analysis cannot describe Llama-2-7B or Mixtral: it requires
the MLP width to be a multiple of h (11008 and 14336 are not multiples of 4096).
"""

from __future__ import annotations

import logging

N, DTYPE, T, P, D = 2048, "fp16", 8, 8, 4


def tessera_report(**plan) -> dict:
    from tessera.compiler.analysis import costreport
    from tessera.compiler.analysis.plan import Plan
    from tessera.runtime import pipeline

    built = pipeline.build("gpt2", "gpt3", [])
    return costreport.build_report(built.graph, "gpt2", "gpt3", {}, batch=1, seq=N, dtype=DTYPE, plan=Plan(**plan))


def llm_analysis(train: bool, recompute: str = "none", flash: bool = False) -> dict:
    logging.disable(logging.CRITICAL)  # it logs every intermediate figure
    from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
    from llm_analysis.config import ModelConfig, ParallelismConfig, get_dtype_config_by_name, get_gpu_config_by_name

    gpt3 = ModelConfig(name="gpt3", num_layers=96, n_head=96, hidden_dim=12288, vocab_size=50257, max_seq_len=N,
                       ffn_embed_dim=4 * 12288)
    a = LLMAnalysis(gpt3, get_gpu_config_by_name("a100-sxm-80gb"), get_dtype_config_by_name("w16a16e16"),
                    ParallelismConfig(tp_size=T, pp_size=P if train else 1, dp_size=D if train else 1))
    if not train:
        return a.inference(batch_size_per_gpu=1, seq_len=N, num_tokens_to_generate=1)
    return a.training(batch_size_per_gpu=1, gradient_accumulation_steps=P, seq_len=N, ds_zero=DSZeRO.STAGE_1,
                      activation_recomputation=ActivationRecomputation[recompute.upper()], flash_attn=flash,
                      softmax_dropout=True)


def rows() -> list[tuple[str, int, int]]:
    out = []
    base = tessera_report(tp=T, pp=P, dp=D, train=True, zero=1, recompute="none")
    la = llm_analysis(True)
    tr = base["memory"]["training"]["per_device"]
    out += [("parameters, whole model", base["params"]["total"], int(la["num_params_total"])),
            ("weights", tr["weights"], int(la["weight_memory_per_gpu"])),
            ("gradients", tr["gradients"], int(la["gradient_memory_per_gpu"])),
            ("optimizer + master weights (ZeRO-1)", tr["optimizer"] + tr["master_weights"],
             int(la["optimizer_state_memory_per_gpu"])),
            ("activations, recompute none, attention not fused", tr["activations"],
             int(la["activation_memory_per_gpu"]))]
    for r in ("selective", "full"):
        t = tessera_report(tp=T, pp=P, dp=D, train=True, zero=1, recompute=r)["memory"]["training"]["per_device"]
        out.append((f"activations, {r}", t["activations"], int(llm_analysis(True, r)["activation_memory_per_gpu"])))
    out.append(("activations, none, fused attention", tr["activations_fused"],
                int(llm_analysis(True, "none", flash=True)["activation_memory_per_gpu"])))
    inf = tessera_report(tp=T)["parallel"]["per_device"]
    li = llm_analysis(False)
    out += [("inference, T = 8: weights", inf["weights_bytes"], int(li["weight_memory_per_gpu"])),
            ("inference, T = 8: KV cache at N", inf["kv_cache_bytes"], int(li["kv_cache_memory_per_gpu"]))]
    return out


def main() -> None:
    print("| figure (bytes per device) | tessera | llm-analysis | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, ours, theirs in rows():
        print(f"| {name} | {ours:,} | {theirs:,} | {ours / theirs:.3f} |")


if __name__ == "__main__":
    main()
