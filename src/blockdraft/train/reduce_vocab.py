"""Derive a reduced-vocabulary DFlash draft from a full-vocabulary one: same layers, but it proposes only among the N
most frequent response tokens of its training records (the vLLM `d2t` mapping saved in the checkpoint);
verification stays over the full vocabulary, so decoding stays lossless. The draft's LM-head product shrinks from
V x H to N x H per block row.

With held-out records it also reports their coverage: the share of their response tokens inside the subset, an
upper bound on how often the reduced draft can still propose the right token.

    blockdraft reduce-vocab --draft runs/smollm2-l2/draft --data data/smollm2-regen --size 8192 --out runs/v8k
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.draft import DFlashDraftModel
from ..models.draft_config import DFlashConfig
from ..models.loading import load_target
from .live import frequent_tokens
from .records import load_records


def reduced_draft(full: DFlashDraftModel, ids: torch.Tensor) -> DFlashDraftModel:
    """full's layers proposing only among the target ids [N] (sorted)."""
    d = full.config.to_hf_dict()
    d["draft_vocab_size"] = int(ids.numel())
    small = DFlashDraftModel(DFlashConfig.from_hf_dict(d))
    state = {k: v for k, v in full.state_dict().items() if k != "d2t"}
    missing, unexpected = small.load_state_dict(state, strict=False)
    if unexpected or missing != ["d2t"]:
        raise ValueError(f"cannot reduce this draft's vocabulary: missing {missing}, unexpected {unexpected}")
    small.set_draft_vocab(ids)
    return small


def coverage(ids: torch.Tensor, records: list[dict], vocab_size: int) -> tuple[int, float]:
    """(response tokens of the records, the share of them among ids)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    toks = torch.cat([torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"], dtype=torch.bool)] for r in records])
    return int(toks.numel()), float(inside[toks].float().mean())


@dataclass(frozen=True)
class ReduceVocabConfig:
    """`blockdraft reduce-vocab`: the full-vocabulary draft, its training records (data), the output directory; size:
    the tokens kept; heldout: held-out records whose coverage is reported; target: the draft's target (None: the
    packaged default)."""

    draft: str
    data: str
    out: str
    size: int = 8192
    heldout: str | None = None
    target: str | None = None


def run(cfg: ReduceVocabConfig) -> int:
    """`blockdraft reduce-vocab`: write the reduced draft and its report (reduce_vocab.json) to cfg.out."""
    target, _ = load_target(cfg.target, "bf16")
    full = DFlashDraftModel.from_pretrained(cfg.draft)
    recs = load_records(cfg.data)
    ids = frequent_tokens(recs, cfg.size, target.vocab_size, target.eos_token_ids + (full.mask_token_id,))
    reduced_draft(full, ids).save_pretrained(cfg.out)
    report = {"draft": cfg.draft, "size": cfg.size, "out": cfg.out, "train_records": len(recs)}
    if cfg.heldout:
        n, share = coverage(ids, load_records(cfg.heldout), target.vocab_size)
        report.update(heldout_tokens=n, heldout_coverage=share)
    (Path(cfg.out) / "reduce_vocab.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0
