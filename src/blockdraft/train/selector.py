"""Fitting a chain selector (`models/selector.py`) to a trained draft, which stays frozen.

The draft runs once over teacher caches (`teacher.py`) at random anchors, as training does; each labelled block row
keeps what the selector reads: the draft's hidden state, its K best scores and their target ids, the true token
before the row and the index of the target's greedy token among the K (or none). The selector is then fitted with
cross-entropy over the K candidates, rows weighted exp(-(k-1)/gamma) like the draft's own loss; rows whose greedy
token is not among the K teach it nothing (no choice among them is accepted) and are left out. Held-out rows, every
row of fixed anchors' blocks, give the teacher-forced acceptance per row and the tau it implies with the draft's own
choice and with the selector's; teacher forcing is exact here, since row k is verified only when the rows before
it hold the true tokens.

Costs: one draft forward per sequence (no backward) and a few passes of a small MLP over the rows. Resumable: the
collected rows are written in parts as they are made and the fit checkpoints after each epoch; a run killed and
started again with the same config continues where it stopped and ends with the same weights.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.copy_gate import LookupTables
from ..models.draft import DFlashDraftModel, check_compatible
from ..models.loading import load_target
from ..models.selector import ChainSelector
from .batches import DraftHead, fused_inputs, make_batch, valid_anchors
from .blockattn import block_forward
from .blocks import default_gamma, loss_weights
from .cached import open_caches
from .curve import heldout_anchors
from .precision import autocast, compute_dtype, dtype_name

log = logging.getLogger(__name__)

ROW_FIELDS = ("hidden", "prev", "top_s", "top_ids", "label", "offset", "block")


@dataclass(frozen=True)
class SelectorConfig:
    """`blockdraft train-selector`: fit a selector of width `rank` over the `top_k` best columns to the draft in
    `draft`, from the teacher caches `cache` (comma-separated) and `heldout_cache`, into `out_dir` (its `draft/` is
    the draft with the selector). block: rows per block (default: the draft's decode block); anchors: per training
    sequence; limit: training sequences (0: all)."""

    draft: str
    cache: str
    heldout_cache: str
    out_dir: str
    target: str | None = None
    rank: int = 256
    top_k: int = 16
    block: int | None = None
    anchors: int = 64
    max_len: int = 640
    limit: int = 0
    epochs: int = 2
    batch_rows: int = 2048
    lr: float = 2e-3
    weight_decay: float = 0.01
    gamma: float | None = None
    eval_seqs: int = 48
    eval_anchors: int = 24
    part_seqs: int = 256
    seed: int = 0
    threads: int | None = None
    precision: str = "auto"

    def __post_init__(self) -> None:
        for name in ("rank", "top_k", "anchors", "epochs", "batch_rows", "part_seqs", "eval_seqs", "eval_anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block is not None and self.block < 2:
            raise ValueError(f"block must be >= 2, got {self.block}")
        if self.limit < 0 or self.lr <= 0:
            raise ValueError("limit must be >= 0 and lr > 0")

    # What the training state depends on: a run continued with other values would mix two fits.
    def fingerprint(self) -> dict:
        d = asdict(self)
        for k in ("out_dir", "threads", "target"):
            d.pop(k)
        return d


@torch.no_grad()
def collect_rows(draft: DFlashDraftModel, target, head: DraftHead, seqs, anchor_lists, cols, block: int,
                 max_len: int, top_k: int, dtype: torch.dtype, tables: LookupTables | None,
                 block_offset: int = 0, batch_seqs: int = 4) -> dict[str, torch.Tensor]:
    """The rows the selector reads, for every row k >= 1 of the blocks at `anchor_lists` of `seqs` ->
    {hidden [R, H] bf16, prev [R] the true token before the row, top_s [R, K] fp32 the draft's K best scores,
    top_ids [R, K] their target ids, label [R] the greedy token's index among them (-1: not among them or no
    label), offset [R] k, block [R] a block number (block_offset + the block's index here)}."""
    parts: dict[str, list[torch.Tensor]] = {f: [] for f in ROW_FIELDS}
    nblocks = block_offset
    for s in range(0, len(seqs), batch_seqs):
        part, al = seqs[s:s + batch_seqs], anchor_lists[s:s + batch_seqs]
        c = cols[s:s + batch_seqs] if isinstance(cols, list) else cols
        b = make_batch(part, al, block, draft.mask_token_id, c, max_len, with_topk=False)
        with autocast(dtype):
            hidden = block_forward(draft, fused_inputs(draft, target, b), b.ctx_len, target.embed(b.block_ids),
                                   b.anchors, block)
        h = hidden.float().reshape(-1, hidden.shape[-1])
        cand = n = None
        if tables is not None:
            cand, n = (x.reshape(-1) for x in tables.rows(part, al, block, max_len))
        scores = head.scores(h, None if cand is None else (cand, n, b.offsets.reshape(-1)))
        labels, offs = b.labels.reshape(-1), b.offsets.reshape(-1)
        # the real rows: k >= 1 of each sequence's own anchors (make_batch pads every sequence to the most anchors)
        real = torch.zeros(len(part), b.anchors.shape[1] * block, dtype=torch.bool)
        prev = torch.zeros(len(part), b.anchors.shape[1] * block, dtype=torch.long)
        blk = torch.zeros_like(prev)
        for i, (q, a) in enumerate(zip(part, al)):
            r = len(a) * block
            real[i, :r] = True
            pos = (torch.from_numpy(np.asarray(a, dtype=np.int64)).unsqueeze(1) + torch.arange(block) - 1).reshape(-1)
            toks = torch.from_numpy(np.asarray(q.tokens, dtype=np.int64))
            prev[i, :r] = toks[pos.clamp(0, len(toks) - 1)]
            blk[i, :r] = nblocks + torch.arange(len(a)).repeat_interleave(block)
            nblocks += len(a)
        keep = real.reshape(-1) & (offs > 0)
        top_s, top_c = scores[keep].topk(min(top_k, scores.shape[1]), dim=-1)
        kc = cand[keep] if cand is not None else None
        top_ids = head.target_ids(top_c, kc)
        col = head.columns(labels[keep], kc)
        hit = (top_c == col.unsqueeze(1)) & (col >= 0).unsqueeze(1)
        label = torch.where(hit.any(1), hit.long().argmax(1), torch.full_like(col, -1))
        for f, v in (("hidden", h[keep].to(torch.bfloat16)), ("prev", prev.reshape(-1)[keep]), ("top_s", top_s),
                     ("top_ids", top_ids), ("label", label), ("offset", offs[keep]), ("block", blk.reshape(-1)[keep])):
            parts[f].append(v)
    return {f: torch.cat(v) if v else torch.zeros(0) for f, v in parts.items()}


def selector_loss(selector: ChainSelector, rows: dict[str, torch.Tensor], head_weight: torch.Tensor, embed,
                  gamma: float | None) -> torch.Tensor:
    """Weighted cross-entropy over the K candidates of rows whose greedy token is among them."""
    ok = rows["label"] >= 0
    r = {k: v[ok] for k, v in rows.items()}
    if not bool(ok.any()):
        return torch.zeros((), requires_grad=True)
    with torch.no_grad():
        head_rows = head_weight[r["top_ids"]]
        prev_emb = embed(r["prev"])
    s = selector.candidate_scores(r["top_s"], head_rows, r["hidden"], prev_emb)
    w = loss_weights(r["offset"], gamma)
    return (F.cross_entropy(s, r["label"], reduction="none") * w).sum() / w.sum().clamp_min(1e-8)


@torch.no_grad()
def held_out_scores(selector: ChainSelector | None, rows: dict[str, torch.Tensor], head_weight: torch.Tensor, embed,
                    block: int, batch_rows: int = 4096) -> dict:
    """Teacher-forced acceptance per block row and the tau it implies at `block`, with the draft's own choice
    (selector None) or the selector's."""
    hits = []
    for s in range(0, rows["label"].shape[0], batch_rows):
        r = {k: v[s:s + batch_rows] for k, v in rows.items()}
        if selector is None:
            choice = torch.zeros_like(r["label"])  # the draft's best column
        else:
            choice = selector.candidate_scores(r["top_s"], head_weight[r["top_ids"]], r["hidden"],
                                               embed(r["prev"])).argmax(-1)
        hits.append((choice == r["label"]) & (r["label"] >= 0))
    hit = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)
    off, blk = rows["offset"], rows["block"]
    acc = [round(float(hit[off == k].float().mean()), 4) if bool((off == k).any()) else 0.0 for k in range(1, block)]
    # rows are stored block by block, k ascending: a block's accepted prefix is its leading run of hits
    nb = int(blk.max()) + 1 if blk.numel() else 0
    grid = torch.zeros(nb, block - 1, dtype=torch.long)
    grid[blk, off - 1] = hit.long()
    used = torch.zeros(nb, dtype=torch.bool)
    used[blk] = True
    run = grid[used].cumprod(-1).sum(-1).float()
    return {"acc": acc, "tau": round(1.0 + float(run.mean()), 4) if run.numel() else 1.0, "blocks": int(used.sum())}


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _rows(path: Path, make) -> dict[str, torch.Tensor]:
    if path.is_file():
        return torch.load(path, weights_only=True)
    rows = make()
    _save_atomic(rows, path)
    return rows


def train_selector(cfg: SelectorConfig, target=None, progress: bool = True) -> dict:
    """Fit the selector (resuming from `out_dir` when it holds a run of the same config); write `out_dir/draft`
    and `out_dir/selector_log.jsonl`; returns the last held-out evaluation."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "selector_state.json"
    fp = cfg.fingerprint()
    if state_path.is_file():
        prior = json.loads(state_path.read_text())
        if prior.get("config") != fp:
            raise FileExistsError(f"{out} holds a selector run of another config: choose another --out")
    else:
        state_path.write_text(json.dumps({"config": fp}))
    dtype = compute_dtype(cfg.precision)
    if target is None:
        if not cfg.target:
            raise ValueError("no target model: pass --target")
        target, _ = load_target(cfg.target, dtype_name(dtype), weights="bf16")
    target.requires_grad_(False)
    draft = DFlashDraftModel.from_pretrained(cfg.draft, dtype=torch.float32).without_selector().eval()
    check_compatible(draft.config, target)
    block = cfg.block or draft.config.decode_block_size or draft.config.block_size
    if block > draft.config.block_size:
        raise ValueError(f"block {block} is longer than the draft's block ({draft.config.block_size})")
    layer_ids = draft.config.target_layer_ids
    caches, held = open_caches(_CacheSpec(cfg.cache, cfg.heldout_cache))
    head = DraftHead(target, draft)
    tables = LookupTables(draft.config.block_size - 1) if draft.copy_gate is not None else None
    embed, head_weight = target.embed, head.full_weight
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(draft.config.block_size)

    # the training sequences and their anchors, drawn once from the seed (a resumed run draws the same)
    g = np.random.default_rng(cfg.seed)
    seqs, cols, anchors = [], [], []
    for c in caches:
        cc = c.columns(layer_ids)
        for q in c.sequences:
            a = valid_anchors(q, cfg.max_len)
            if len(a):
                seqs.append(q)
                cols.append(cc)
                anchors.append(np.sort(g.choice(a, size=min(cfg.anchors, len(a)), replace=False)))
    if cfg.limit:
        seqs, cols, anchors = seqs[: cfg.limit], cols[: cfg.limit], anchors[: cfg.limit]
    if not seqs:
        raise ValueError(f"no training sequence with a response anchor in {cfg.cache}")
    t0 = time.perf_counter()
    (out / "rows").mkdir(exist_ok=True)
    parts = []
    n_parts = (len(seqs) + cfg.part_seqs - 1) // cfg.part_seqs
    for j in range(n_parts):
        sl = slice(j * cfg.part_seqs, (j + 1) * cfg.part_seqs)
        parts.append(_rows(out / "rows" / f"part-{j:05d}.pt", lambda: collect_rows(
            draft, target, head, seqs[sl], anchors[sl], cols[sl], block, cfg.max_len, cfg.top_k, dtype, tables)))
        if progress:
            log.info("selector rows: part %d of %d", j + 1, n_parts)
    rows = {f: torch.cat([p[f] for p in parts]) for f in ROW_FIELDS}
    del parts
    hseqs, hanchors = heldout_anchors(held, cfg.eval_seqs, cfg.eval_anchors, cfg.max_len, cfg.seed)
    held_rows = _rows(out / "rows" / "heldout.pt", lambda: collect_rows(
        draft, target, head, hseqs, hanchors, held.columns(layer_ids), block, cfg.max_len, cfg.top_k, dtype, tables))
    collect_s = time.perf_counter() - t0

    hidden = draft.config.hidden_size
    torch.manual_seed(cfg.seed)
    selector = ChainSelector(hidden, cfg.rank, cfg.top_k)
    opt = torch.optim.AdamW(selector.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = out / "selector_ckpt.pt"
    epoch, fit_s = 0, 0.0
    log_path = out / "selector_log.jsonl"
    if ckpt.is_file():
        blob = torch.load(ckpt, weights_only=False)
        selector.load_state_dict(blob["selector"])
        opt.load_state_dict(blob["opt"])
        epoch, fit_s = blob["epoch"], blob["fit_seconds"]
        log.info("resumed the selector fit after epoch %d", epoch)
    else:
        base = held_out_scores(None, held_rows, head_weight, embed, block)
        _log(log_path, {"epoch": 0, "draft": base, "rows": int(rows["label"].shape[0]),
                        "rows_in_top_k": round(float((rows["label"] >= 0).float().mean()), 4),
                        "collect_seconds": round(collect_s, 1)}, fresh=True)
    n = rows["label"].shape[0]
    steps = cfg.epochs * ((n + cfg.batch_rows - 1) // cfg.batch_rows)
    step = epoch * ((n + cfg.batch_rows - 1) // cfg.batch_rows)
    last = None
    while epoch < cfg.epochs:
        t1 = time.perf_counter()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        total, count = 0.0, 0
        for s in range(0, n, cfg.batch_rows):
            idx = order[s:s + cfg.batch_rows]
            for grp in opt.param_groups:  # cosine from lr to lr / 10 over the whole fit
                grp["lr"] = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * step / max(1, steps))))
            loss = selector_loss(selector, {k: v[idx] for k, v in rows.items()}, head_weight, embed, gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            total += float(loss.detach())
            count += 1
        epoch += 1
        fit_s += time.perf_counter() - t1
        last = held_out_scores(selector, held_rows, head_weight, embed, block)
        _log(log_path, {"epoch": epoch, "loss": round(total / max(1, count), 4), "selector": last,
                        "fit_seconds": round(fit_s, 1)})
        _save_atomic({"selector": selector.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                      "fit_seconds": fit_s}, ckpt)
        if progress:
            log.info("selector epoch %d: loss %.4f, held-out %s", epoch, total / max(1, count), last)
    if last is None:
        last = held_out_scores(selector, held_rows, head_weight, embed, block)
    result = draft.with_selector(cfg.rank, cfg.top_k)
    result.selector.load_state_dict(selector.state_dict())
    result.config.extra["selector_training"] = {
        "rows": int(n), "epochs": cfg.epochs, "block": block, "sequences": len(seqs),
        "minutes": round((collect_s + fit_s) / 60, 2), "cache": cfg.cache}
    result.save_pretrained(out / "draft")
    return {"out": str(out / "draft"), "block": block, "rows": int(n),
            "draft": held_out_scores(None, held_rows, head_weight, embed, block), "selector": last}


@dataclass(frozen=True)
class _CacheSpec:
    # what `open_caches` reads of a training config
    cache: str
    heldout_cache: str


def _log(path: Path, entry: dict, fresh: bool = False) -> None:
    with open(path, "w" if fresh else "a") as f:
        f.write(json.dumps(entry) + "\n")
