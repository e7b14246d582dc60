"""Runs inside the vLLM venv (not collected by pytest): a real vLLM CPU engine driven over stdin.

argv[1] is JSON {"model_dir", "endpoint", "topic"}. The script builds a tiny random-weight Llama
(no hub access), starts ``vllm.LLM`` with prefix caching and KV events published to ``endpoint``,
prints ``READY``, then executes one JSON command per stdin line and answers ``DONE <json>``:
``{"op": "generate", "tokens": [...]}``, ``{"op": "reset"}`` (reset_prefix_cache, then one tiny
request so the engine steps and publishes AllBlocksCleared), ``{"op": "exit"}``.
Markers go to the original stdout; everything else vLLM prints is moved to stderr.
"""

import json
import os
import sys


def make_model(model_dir: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=512, initializer_range=0.25,
                       tie_word_embeddings=False)
    LlamaForCausalLM(conf).save_pretrained(model_dir, safe_serialization=True)


def main() -> None:
    marker = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    cfg = json.loads(sys.argv[1])
    make_model(cfg["model_dir"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    llm = LLM(model=cfg["model_dir"], skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              max_num_seqs=2, max_num_batched_tokens=512, block_size=32,
              enable_prefix_caching=True, prefix_caching_hash_algo="sha256", enforce_eager=True,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=cfg["endpoint"], topic=cfg["topic"]))
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    marker.write("READY\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            out = llm.generate([{"prompt_token_ids": cmd["tokens"]}], params, use_tqdm=False)
            marker.write("DONE " + json.dumps(list(out[0].outputs[0].token_ids)) + "\n")
        elif cmd["op"] == "reset":
            ok = llm.reset_prefix_cache()
            llm.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)
            marker.write("DONE " + json.dumps(bool(ok)) + "\n")
        else:
            break
    marker.write("BYE\n")


if __name__ == "__main__":
    main()
