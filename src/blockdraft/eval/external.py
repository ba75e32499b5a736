"""External reference decoders for `blockdraft bench`: what a user would run instead of blockdraft.

- `hf_generate`: Hugging Face `generate` on the same HF model (plain, or with its prompt-lookup assistant);
- `LlamaCpp`: llama.cpp through llama-cpp-python on the target's GGUF file (plain, or with llama-cpp-python's
  prompt-lookup draft), the runtime CPU users pick today. It is an optional extra (see the README:
  the source build needs ggml's AMX kernels switched off on CPUs where they crash).

Each returns the same record fields as the engine's runs. Decode tokens/s is measured the same way for all: tokens
after the first one, over the time after the first one arrived (a streamer/generator tells when that is).
"""

from __future__ import annotations

import time
from pathlib import Path


def _record(ids, new: list[int], eos, tok, t0: float, t_first: float | None, t_end: float) -> dict:
    stop = next((i for i, t in enumerate(new) if t in eos), None)
    if stop is not None:
        del new[stop + 1:]
    text = tok.decode(new, skip_special_tokens=True) if tok is not None else ""
    decode_s = (t_end - t_first) if t_first is not None else None
    tps = (len(new) - 1) / decode_s if decode_s and len(new) > 1 else None
    return {"token_ids": new, "text": text, "finish_reason": "stop" if stop is not None else "length",
            "prompt_tokens": len(ids), "new_tokens": len(new), "tau": None, "accept_lengths": None,
            "position_accepted": None, "position_trials": None, "target_forwards": None,
            "decode_tokens_per_s": tps, "e2e_seconds": t_end - t0,
            "prefill_seconds": None if t_first is None else t_first - t0, "decode_seconds": decode_s,
            "draft_seconds": None, "verify_seconds": None}


def hf_generate(target, tok, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
                prompt_lookup_tokens: int | None = None) -> dict:
    """`target.hf.generate` (eager, its own dynamic cache), greedy or sampled at `temperature` (no top-k/top-p)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token: the second call marks the first
        generated token."""

        def __init__(self) -> None:
            self.calls, self.t_first = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                self.t_first = time.perf_counter()

        def end(self) -> None:
            pass

    eos = list(target.eos_token_ids)
    inp = torch.tensor([ids], dtype=torch.long, device=target.device)
    kw = dict(attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens, top_p=None, top_k=None)
    if temperature > 0:
        torch.manual_seed(seed)
        kw.update(do_sample=True, temperature=temperature)
    else:
        kw.update(do_sample=False, temperature=None)
    if prompt_lookup_tokens:
        kw["prompt_lookup_num_tokens"] = prompt_lookup_tokens
    if eos:
        kw.update(eos_token_id=eos, pad_token_id=eos[0])
    streamer = None if prompt_lookup_tokens else FirstToken()  # assisted generation streams whole chunks
    t0 = time.perf_counter()
    with torch.no_grad():
        out = target.hf.generate(inp, streamer=streamer, **kw)
    t_end = time.perf_counter()
    return _record(ids, out[0, len(ids):].tolist(), eos, tok, t0, streamer and streamer.t_first, t_end)


def llamacpp_available() -> str | None:
    """None if llama-cpp-python is importable, else the install hint."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ("llama-cpp-python is not installed (optional: `make llamacpp`, see the README; a plain source "
                "build crashes with SIGILL on CPUs whose AMX ggml kernels fail)")
    return None


class LlamaCpp:
    """Plain (or prompt-lookup) decoding of a GGUF file through llama-cpp-python, n_threads = the bench's threads."""

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int, prompt_lookup: tuple[int, int] | None = None):
        from llama_cpp import Llama

        draft = None
        if prompt_lookup is not None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=prompt_lookup[0], num_pred_tokens=prompt_lookup[1])
        # logits_all with a draft: llama-cpp-python turns it on internally but sizes its score buffer from the
        # argument, and a verify of several tokens then overflows that buffer (0.3.36)
        self.llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, draft_model=draft,
                         logits_all=draft is not None, verbose=False)

    def run(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int, eos, tok) -> dict:
        llm = self.llm
        llm.reset()
        llm.set_seed(seed)
        if temperature > 0:  # the full distribution at this temperature: every truncation switched off
            kw = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0)
        else:
            kw = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)
        new: list[int] = []
        t0 = time.perf_counter()
        t_first = None
        for t in llm.generate(ids, repeat_penalty=1.0, reset=True, **kw):
            if t_first is None:
                t_first = time.perf_counter()
            new.append(int(t))
            if len(new) >= max_new_tokens or int(t) in eos:
                break
        return _record(ids, new, eos, tok, t0, t_first, time.perf_counter())
