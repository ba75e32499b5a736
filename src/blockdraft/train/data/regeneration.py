"""Regeneration: the target answers the training prompts (its own chat template and decoding) into resumable JSONL
shards, through the decode engine; and the selection of the prompts a regeneration run answers."""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from ...config import GenerationConfig, SamplingParams
from ...decode.spec import DecodeSpec, build_engine
from ...models.loading import load_hf_target
from ...models.quant import plan_weights
from ...models.target import TargetModel
from ...prompts.base import Prompt
from ..records import ShardWriter, read_shards
from ..teacher import TeacherCacheWriter, recorded_arrays, teacher_spec
from .prompt_set import PromptSetReport, build_prompt_set, write_prompts_jsonl
from .sources import gsm_prompts, jsonl_prompts, sharegpt_prompts

log = logging.getLogger(__name__)

# Regeneration
# ----------------------------------------------------------------------------------------------------------------

SORT_WINDOW_BATCHES = 32  # prompts are length-sorted within windows of this many batches


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, ending with the generation prompt."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def plan_batches(lengths: Sequence[int], batch_size: int, window: int) -> list[list[int]]:
    """Batches of indices: within consecutive windows of `window` items, longest first (stable), then chunked."""
    batches = []
    for start in range(0, len(lengths), window):
        idx = sorted(range(start, min(start + window, len(lengths))), key=lambda i: (-lengths[i], i))
        batches += [idx[k:k + batch_size] for k in range(0, len(idx), batch_size)]
    return batches


@dataclass(frozen=True)
class RecordSpec:
    """Teacher data written in the same pass as the answers (`FeatureRecorder`): the tapped target layers, the
    top-k kept per position and the positions kept per record, into a teacher cache at `out_dir` (train/teacher.py:
    what `blockdraft train --cache` reads)."""

    out_dir: str | Path
    layer_ids: tuple[int, ...]
    topk: int = 16
    max_len: int = 512
    feats: str = "bf16"  # how the cache holds the features (`teacher.FEATS`: bf16, or int8 at half the bytes)

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("recording teacher data needs the target layers to tap")
        if self.topk < 1 or self.max_len < 2:
            raise ValueError(f"need topk >= 1 and max_len >= 2, got {self.topk} and {self.max_len}")


@dataclass
class RegenReport:
    total: int = 0  # prompts given
    skipped_long: int = 0  # over max_prompt_tokens
    already_done: int = 0  # found in existing shards
    generated: int = 0  # records written by this call
    new_tokens: int = 0  # response tokens written by this call
    batches: int = 0
    seconds: float = 0.0
    truncated_bytes: int = 0  # partial last line dropped on resume
    stopped_early: bool = False  # max_batches reached
    recorded: int = 0  # records whose teacher data this call wrote (with a RecordSpec)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def regenerate(model, tokenizer, prompts: Sequence[Prompt], out_dir: str | Path, max_new_tokens: int = 256,
               temperature: float = 0.0, batch_size: int = 8, max_prompt_tokens: int = 512, shard_size: int = 1000,
               seed: int = 0, max_batches: int | None = None,
               on_batch: Callable[[list[dict]], None] | None = None, progress: bool = True,
               progress_interval: float = 1.0, lean: bool = True, weights=None,
               record: RecordSpec | None = None) -> RegenReport:
    """Answer every prompt with the target and append {id, input_ids, loss_mask} records to
    `out_dir/shard-NNNNN.jsonl` (flushed and fsynced after every `batch_size` finished answers).

    Resumable: records already in `out_dir` are kept and their ids skipped; a partially written last line is
    truncated. Prompts are answered in an order that depends only on `prompts` (length-sorted within windows), up
    to `batch_size` rows in the decode engine at once, refilled as answers finish; each answer is what the prompt
    gets alone (sampling draws from a generator seeded per prompt), so an interrupted-then-resumed run writes the
    records of an uninterrupted one (the order within a shard may differ).
    Prompts over `max_prompt_tokens` are skipped (counted). `max_batches` stops after that many writes (answers in
    flight then are dropped); `on_batch(records)` is called after each write. Plain decoding on the decode engine;
    lean: on the target's fused path where its architecture has one;
    weights: the `quant.WeightPlan` that path holds (None: float weights);
    record: also write each answer's teacher data (features, top-k) from the same pass, into a teacher cache,
    before its record goes into the shards (a record found in the cache on resume is not written twice; one in the
    shards without teacher data, from a run without `record`, is left to `blockdraft teacher-cache`).
    """
    t0 = time.perf_counter()
    rep = RegenReport(total=len(prompts))
    if len({p.id for p in prompts}) != len(prompts):
        raise ValueError("prompt ids must be unique")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    writer = ShardWriter(Path(out_dir), shard_size)
    rep.truncated_bytes = writer.truncated_bytes
    todo_ids, tok = [], []
    for p in prompts:
        ids = chat_token_ids(tokenizer, p.messages)
        if len(ids) > max_prompt_tokens:
            rep.skipped_long += 1
            continue
        todo_ids.append(p.id)
        tok.append(ids)
    batches = plan_batches([len(t) for t in tok], batch_size, batch_size * SORT_WINDOW_BATCHES)
    rep.already_done = sum(1 for pid in todo_ids if pid in writer.done)
    remaining = len(todo_ids) - rep.already_done
    eos = _eos_ids(model, tokenizer)
    target = TargetModel(model, tokenizer, lean=lean, weights=weights)
    spec = DecodeSpec("ar") if record is None else DecodeSpec("ar", record_layers=tuple(record.layer_ids),
                                                               record_topk=record.topk)
    cache = None if record is None else TeacherCacheWriter(record.out_dir, dict(teacher_spec(
        target, record.layer_ids, record.topk, record.max_len, feats=record.feats), source="regeneration"))
    engine = build_engine(target, None, spec, tokenizer=tokenizer, max_batch=max(1, batch_size))
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=tuple(eos), ignore_eos=True)

    bar = None
    if progress and remaining:
        bar = tqdm(total=remaining, unit="prompt", desc="regenerate", mininterval=progress_interval)
    t_gen = time.perf_counter()
    # rows are refilled as they finish (a batch waiting on its longest answer would decode its last tokens a few rows
    # at a time); each row is computed as it would be alone, so which rows share a step changes nothing
    order = iter(i for batch in batches for i in batch if todo_ids[i] not in writer.done)
    rows: dict = {}  # engine request id -> (prompt index, its recorder or None)
    records: list[dict] = []
    recorded: dict[str, dict] = {}  # record id -> teacher arrays, written before the record

    def refill() -> None:
        while len(rows) < batch_size and (max_batches is None or rep.batches < max_batches):
            i = next(order, None)
            if i is None:
                return
            # a prompt's draws depend on the run's seed and its own index only, not on the rows beside it
            sampling = SamplingParams(temperature=float(temperature), seed=seed * 1_000_003 + i)
            rid = engine.add(tok[i], config, sampling, text=False)
            rows[rid] = (i, engine.proposer_of(rid) if record is not None else None)

    def flush() -> None:
        if cache is not None:
            fresh = [r["id"] for r in records if r["id"] not in cache.done]
            if fresh:
                arrays = [recorded.pop(k) for k in fresh]
                cache.write_chunk(fresh, {k: [a[k] for a in arrays] for k in arrays[0]},
                                  [len(a["tokens"]) for a in arrays])
                rep.recorded += len(fresh)
            recorded.clear()
        writer.write(records)
        rep.generated += len(records)
        rep.batches += 1
        if bar is not None:
            bar.update(len(records))
            bar.set_postfix(tok_s=f"{rep.new_tokens / max(time.perf_counter() - t_gen, 1e-9):.1f}", refresh=False)
        if on_batch is not None:
            on_batch(list(records))
        records.clear()

    try:
        refill()
        while rows:
            for ev in engine.step():
                if not ev.finished:
                    continue
                i, rec = rows.pop(ev.request_id)
                resp = ev.result.token_ids
                cut = next((k + 1 for k, t in enumerate(resp) if t in eos), len(resp))
                resp = resp[:cut]
                records.append({"id": todo_ids[i], "input_ids": tok[i] + resp,
                                "loss_mask": [0] * len(tok[i]) + [1] * len(resp)})
                if rec is not None:  # read now: the engine may hand this recorder to the next request
                    feats, top_ids, top_logits = rec.recorded()
                    recorded[todo_ids[i]] = recorded_arrays(records[-1]["input_ids"], records[-1]["loss_mask"],
                                                            feats, top_ids, top_logits, rec.first_logit_position,
                                                            record.topk, record.max_len, record.feats)
                rep.new_tokens += len(resp)
                if len(records) == batch_size:
                    flush()
            if max_batches is not None and rep.batches >= max_batches:
                rep.stopped_early = bool(rows) or next(order, None) is not None
                break
            refill()
        if records:
            flush()
    finally:
        writer.close()
        if bar is not None:
            bar.close()
        rep.seconds = time.perf_counter() - t0
    return rep


# ----------------------------------------------------------------------------------------------------------------
# End-to-end
# ----------------------------------------------------------------------------------------------------------------


def _take_fitting(prompts: Iterable[Prompt], n: int, fits: Callable[[Prompt], bool]) -> list[Prompt]:
    out = []
    for p in prompts:
        if len(out) >= n:
            break
        if fits(p):
            out.append(p)
    return out


def select_regeneration_prompts(tokenizer, n_sharegpt: int = 6000, n_gsm: int = 3000,
                                heldout_fraction: float = 0.02, seed: int = 0, max_prompt_tokens: int = 512,
                                extra_jsonl: Sequence[str | Path] = (), heldout: bool = True,
                                ) -> tuple[list[Prompt], list[Prompt], PromptSetReport]:
    """The (train, heldout, report) prompts `run_regeneration` answers; deterministic for the arguments.

    All ShareGPT first turns, a GSM-style pool and any user JSONL files are deduped, decontaminated against the
    eval tasks and split (`build_prompt_set`); from the train side, the first `n_sharegpt` ShareGPT prompts (seeded
    shuffle) and the first `n_gsm` math prompts whose chat-templated length fits `max_prompt_tokens` are kept,
    plus every user JSONL prompt; the held-out side keeps the same proportion (heldout_fraction /
    (1 - heldout_fraction) of those counts, at least one per requested source). Each side is then shuffled (seeded) so that the sources are
    interleaved and a partially finished regeneration is already a representative mix.
    """
    sg = sharegpt_prompts()
    random.Random(seed).shuffle(sg)
    ratio = heldout_fraction / (1 - heldout_fraction)
    gsm_pool = gsm_prompts(int((n_gsm * (1 + ratio)) * 1.1) + 64, seed=seed + 1)
    user = [p for path in extra_jsonl for p in jsonl_prompts(path)]
    train_all, held_all, rep = build_prompt_set({"sharegpt": sg, "gsm": gsm_pool, "jsonl": user}, seed=seed,
                                                heldout_fraction=heldout_fraction)

    def fits(p: Prompt) -> bool:
        return len(chat_token_ids(tokenizer, p.messages)) <= max_prompt_tokens

    def select(pool: list[Prompt], n_sg: int, n_math: int) -> list[Prompt]:
        chosen = (_take_fitting((p for p in pool if p.task == "sharegpt"), n_sg, fits)
                  + _take_fitting((p for p in pool if p.task == "gsm"), n_math, fits)
                  + [p for p in pool if p.task == "jsonl"])
        random.Random(seed + 7).shuffle(chosen)  # interleave sources: a partial run is a representative mix
        return chosen

    def held_count(n: int) -> int:
        # at least one held-out prompt per requested source: a small run (a quickstart's dozen prompts) would
        # otherwise round to none and leave the next command without held-out data
        return max(1, int(round(n * ratio))) if n > 0 and ratio > 0 else 0

    train = select(train_all, n_sharegpt, n_gsm)
    held = select(held_all, held_count(n_sharegpt), held_count(n_gsm)) if heldout else []
    return train, held, rep


def _write_prompts_checked(prompts: list[Prompt], path: Path) -> None:
    if path.is_file():
        # split on "\n" only: str.splitlines also breaks at U+2028/U+2029, which JSON leaves unescaped in strings
        old = [json.loads(line)["id"] for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
        if old != [p.id for p in prompts]:
            log.warning("%s changes (different arguments or data?): records of dropped ids stay in the shards",
                        path)
    write_prompts_jsonl(prompts, path)


def pending_of_task(prompts: Sequence[Prompt], task: str, shards: Path) -> list[Prompt]:
    """The prompts of `task` whose records are not yet in `shards`, in their given order. A task-only run plans its
    batches over these alone: mixed into the full plan's batches, the records already written would leave batches
    partly done, and those are regenerated whole."""
    done = {r["id"] for r in read_shards(shards)} if Path(shards).is_dir() else set()
    return [p for p in prompts if p.task == task and p.id not in done]


def run_regeneration(target: str | None = None, out_dir: str | Path = "data/work/regen", n_sharegpt: int = 6000,
                     n_gsm: int = 3000, max_new_tokens: int = 320, batch_size: int = 16,
                     heldout_fraction: float = 0.02, seed: int = 0, dtype: str = "bf16",
                     max_prompt_tokens: int = 512, temperature: float = 0.0, shard_size: int = 1000,
                     num_threads: int | None = None, extra_jsonl: Sequence[str | Path] = (),
                     heldout: bool = True, max_batches: int | None = None, progress_interval: float = 30.0,
                     only_task: str | None = None, weights: str = "auto",
                     record_layers: Sequence[int] = (), record_topk: int = 16, record_max_len: int = 512,
                     record_feats: str = "bf16") -> dict:
    """Build the training prompt set (`select_regeneration_prompts`) and regenerate its answers with the target.
    Re-running with the same arguments continues where the last run stopped.

    Writes `prompts-train.jsonl`, `prompts-heldout.jsonl` and `prompt-set.json` (report + arguments) to `out_dir`,
    then regenerates the held-out prompts into `out_dir/shards-heldout/` (small, done first) and the train prompts
    into `out_dir/shards/`. Returns {"summary": ..., "results": {"heldout": RegenReport, "train": RegenReport}}.
    only_task: regenerate only the train prompts of this task ("sharegpt", "gsm", "jsonl") not yet written, into the
    same shards: the prompt files still list the whole set, and a later run without it skips what is done.
    record_layers: also write the teacher data of every answer from the same pass (`RecordSpec`), into
    `out_dir/teacher-heldout/` and `out_dir/teacher/` (top-k `record_topk`, records cut to `record_max_len`, the
    features held as `record_feats`).
    """
    if only_task not in (None, "sharegpt", "gsm", "jsonl"):
        raise ValueError(f"only_task must be sharegpt, gsm or jsonl, got {only_task!r}")
    if num_threads:
        torch.set_num_threads(num_threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = dict(target=target, n_sharegpt=n_sharegpt, n_gsm=n_gsm, max_new_tokens=max_new_tokens,
                heldout_fraction=heldout_fraction, seed=seed, dtype=dtype, max_prompt_tokens=max_prompt_tokens,
                temperature=temperature, extra_jsonl=[str(p) for p in extra_jsonl], weights=weights,
                record_layers=list(record_layers))

    model, tokenizer, src = load_hf_target(target, dtype=dtype)
    # the answers come from the target as the engine runs it: 'auto' keeps a GGUF target's own quantization
    plan = plan_weights(weights, model, Path(src.path) / src.gguf_file if src.gguf_file else None)
    # a prompt must leave the answer room in the target's context: select only prompts that do
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context and max_prompt_tokens > context - min(max_new_tokens, context // 2):
        max_prompt_tokens = context - min(max_new_tokens, context // 2)
        log.info("prompts capped at %d tokens (the target's context is %d)", max_prompt_tokens, context)
    train, held, rep = select_regeneration_prompts(tokenizer, n_sharegpt, n_gsm, heldout_fraction, seed,
                                                   max_prompt_tokens, extra_jsonl, heldout)
    _write_prompts_checked(train, out_dir / "prompts-train.jsonl")
    _write_prompts_checked(held, out_dir / "prompts-heldout.jsonl")
    summary = {"args": args, "prompt_set": rep.to_json() | {"contaminated_ids": rep.contaminated_ids[:200]},
               "selected": {"train": len(train), "heldout": len(held),
                            "train_by_task": {t: sum(p.task == t for p in train) for t in ("sharegpt", "gsm", "jsonl")}}}
    (out_dir / "prompt-set.json").write_text(json.dumps(summary, indent=1) + "\n")
    log.info("prompt set: %s", summary["selected"])

    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size,
              max_prompt_tokens=max_prompt_tokens, shard_size=shard_size, seed=seed,
              progress_interval=progress_interval, weights=plan)
    if only_task is not None:
        train = pending_of_task(train, only_task, out_dir / "shards")
    results = {}
    rec = (lambda name: RecordSpec(out_dir / name, tuple(record_layers), record_topk, record_max_len, record_feats)
           if record_layers else None)
    if held:
        results["heldout"] = regenerate(model, tokenizer, held, out_dir / "shards-heldout", max_batches=max_batches,
                                        record=rec("teacher-heldout"), **kw)
    results["train"] = regenerate(model, tokenizer, train, out_dir / "shards", max_batches=max_batches,
                                  record=rec("teacher"), **kw)
    for name, r in results.items():
        log.info("%s: %d written (%d already done), %d new tokens in %.0f s = %.1f tok/s", name, r.generated,
                 r.already_done, r.new_tokens, r.seconds, r.tokens_per_s)
    return {"summary": summary, "results": results}
