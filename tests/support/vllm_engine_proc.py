"""A real vLLM engine driven over stdin; runs inside the vLLM venv (tests and benchmarks).

``python -m tests.support.vllm_engine_proc make-model DIR [SPEC_JSON]`` writes a
random-weight float32 Llama plus a word-level tokenizer (no hub access; SPEC overrides
hidden/layers/heads/intermediate/max_pos) and exits.
``... serve CFG_JSON`` starts ``vllm.LLM`` (CFG: model_dir, optional kv_transfer_config,
max_model_len), prints ``READY``, then runs one JSON command per stdin line and answers
``DONE <json>``: ``{"op": "generate", "tokens": [...], "max_tokens": n}`` ->
``{"tokens", "logprobs", "num_cached_tokens", "elapsed_s"}``; ``{"op": "reset"}``;
``{"op": "exit"}``. Markers go to the original stdout; everything vLLM prints goes to stderr.
Only ever started as a subprocess (by :mod:`tests.support.vllm_harness`); nothing imports it.
"""

import json
import os
import sys
import time

TINY = {"hidden": 128, "layers": 2, "heads": 2, "intermediate": 256, "max_pos": 1024}


def make_model(model_dir: str, spec: dict | None = None) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = {**TINY, **(spec or {})}
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=1000, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["heads"], head_dim=s["hidden"] // s["heads"],
                       max_position_embeddings=s["max_pos"], initializer_range=0.25,
                       tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(conf).save_pretrained(model_dir, safe_serialization=True)
    make_tokenizer(model_dir, conf.vocab_size)


def make_tokenizer(model_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer ("t0".."t999") so the OpenAI server can render logprobs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(model_dir)


def serve(cfg: dict) -> None:
    marker = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kvt = cfg.get("kv_transfer_config")
    llm = LLM(model=cfg["model_dir"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=cfg.get("max_model_len", 512), max_num_seqs=2,
              max_num_batched_tokens=cfg.get("max_model_len", 512), block_size=32,
              enable_prefix_caching=True, prefix_caching_hash_algo="sha256", enforce_eager=True,
              tensor_parallel_size=cfg.get("tensor_parallel_size", 1),
              distributed_executor_backend="mp" if cfg.get("tensor_parallel_size", 1) > 1 else None,
              kv_transfer_config=KVTransferConfig(**kvt) if kvt else None,
              disable_hybrid_kv_cache_manager=bool(kvt))
    marker.write("READY\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0,
                                    detokenize=False, ignore_eos=True, logprobs=1)
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": cmd["tokens"]}], params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - t0
            comp = out.outputs[0]
            lps = [step[tok].logprob for tok, step in zip(comp.token_ids, comp.logprobs)]
            marker.write("DONE " + json.dumps({"tokens": list(comp.token_ids), "logprobs": lps,
                                               "num_cached_tokens": out.num_cached_tokens,
                                               "elapsed_s": elapsed}) + "\n")
        elif cmd["op"] == "reset":
            marker.write("DONE " + json.dumps(bool(llm.reset_prefix_cache())) + "\n")
        else:
            break
    marker.write("BYE\n")


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
    else:
        serve(json.loads(sys.argv[2]))
