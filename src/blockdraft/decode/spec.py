"""One way to say how to decode (`DecodeSpec`), one registry of methods, and the one builder of engines.

Every caller (the CLI's generate and chat, the server, the benchmark, regeneration of training data, held-out
evaluation during training) builds its engine with `build_engine(target, draft, spec)`; the method names below are
the one vocabulary of the CLI (`--method`), the server (`--method`) and the benchmark (`--methods`).

Methods (`METHODS`; `ALIASES` maps older names onto them):
- `ar`: no draft, plain autoregressive decoding through the same engine (the baseline);
- `dflash`: the DFlash draft's top-1 chain, a full block every step;
- `dflash-adaptive`: that chain with its width chosen per step (0 .. block size - 1) from the target's measured
  verify cost, the draft's measured time and its running acceptance (`policy.WidthPolicy`);
- `dflash-tree`: a candidate tree of the draft's best branches, verified in one target forward;
- `dflash+lookup`: that tree plus prompt-lookup continuations as extra branches;
- `lookup-tree`: prompt-lookup branches alone as a tree (no draft);
- `pld`: prompt-lookup decoding (n-gram continuation of the committed tokens, no draft);
- `eagle`: an EAGLE-3 drafter's chain (the autoregressive-drafter baseline).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from ..models.draft import DFlashDraftModel, decode_block_size
from ..models.eagle import EagleDraftModel
from ..models.target import TargetModel
from .calibrate import VerifyCost, load_or_measure
from .engine import Engine
from .proposers import Proposer
from .proposers.dflash import DFlashProposer
from .proposers.eagle import EagleProposer
from .proposers.lookup import PromptLookupProposer
from .proposers.tree import TreeProposer

log = logging.getLogger(__name__)

PLD_BLOCK_SIZE = 16  # prompt lookup's default block: it drafts as far as a copy goes, verification is the limit
DRAFT_WEIGHTS = ("auto", "bf16", "int8", "int4")
BATCH_POLICIES = ("always", "measured")
ALIASES = {"none": "ar", "plain": "ar", "lookup": "pld", "prompt-lookup": "pld", "fixed-width": "dflash",
           "adaptive": "dflash-adaptive", "tree": "dflash-tree", "tree-lookup": "dflash+lookup"}


@dataclass(frozen=True)
class DecodeSpec:
    """How to decode: a method of the registry and its settings, checked when made.

    block_size: tokens per verify step (None: the draft's recommended decode block size, else its trained size;
    PLD_BLOCK_SIZE for prompt lookup; an EAGLE draft's own chain length + 1), resolved once by `resolved`;
    denoise_steps: DFlash refinement passes per block; tree_budget: nodes per candidate tree (None: chosen per step
    from the verify-cost calibration); draft_weights: the fused draft's weights (auto: 8-bit when the target runs
    on quantized weights, where the draft reads as many bytes per step as a good share of the target, else bf16;
    int4 halves the bytes again, at some cost in how often its proposals are accepted);
    batch_policy: with several rows, `measured` drafts only in steps where the calibration says it pays (policy.py),
    `always` drafts every step; recalibrate: measure the verify cost again instead of reading the cached one;
    pld_max_ngram / pld_num_pred: prompt lookup's longest n-gram and tokens per proposal (None: the block)."""

    method: str = "dflash"
    block_size: int | None = None
    denoise_steps: int = 1
    tree_budget: int | None = None
    draft_weights: str = "auto"
    batch_policy: str = "always"
    recalibrate: bool = False
    pld_max_ngram: int = 3
    pld_num_pred: int | None = None

    def __post_init__(self) -> None:
        name = ALIASES.get(self.method, self.method)
        if name not in METHODS:
            raise ValueError(f"unknown decoding method {self.method!r}; choose one of {', '.join(METHODS)} "
                             f"(or an alias: {', '.join(sorted(ALIASES))})")
        object.__setattr__(self, "method", name)
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.denoise_steps < 1:
            raise ValueError(f"denoise_steps must be >= 1, got {self.denoise_steps}")
        if self.tree_budget is not None and not 0 <= self.tree_budget <= 1023:
            raise ValueError(f"tree budget must be in 0..1023 nodes, got {self.tree_budget}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {self.draft_weights!r}")
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"batch_policy must be one of {BATCH_POLICIES}, got {self.batch_policy!r}")
        if self.pld_max_ngram < 1:
            raise ValueError(f"pld_max_ngram must be >= 1, got {self.pld_max_ngram}")

    @property
    def entry(self) -> "Method":
        return METHODS[self.method]

    def resolved(self, target: TargetModel, draft) -> "DecodeSpec":
        """This spec for this target and draft: the method the draft allows (an EAGLE draft decodes `eagle`; a
        method whose draft is missing falls back as its registry entry says), the block size and the draft's
        weights made concrete."""
        method = self.entry.method_for(draft)
        bs = self.block_size
        if method in ("dflash", "dflash-adaptive", "dflash-tree", "dflash+lookup"):
            bs = decode_block_size(draft, bs)
        elif method in ("pld", "lookup-tree"):
            bs = bs or PLD_BLOCK_SIZE
        elif method == "eagle":
            bs = bs or draft.config.max_draft_steps + 1
        else:
            bs = 1
        weights = self.draft_weights
        if weights == "auto":
            weights = "int8" if getattr(getattr(target, "weights", None), "mode", "bf16") != "bf16" else "bf16"
        return dataclasses.replace(self, method=method, block_size=bs, draft_weights=weights)


@dataclass(frozen=True)
class Method:
    """A registry entry. draft: the draft it decodes with ("dflash", "eagle" or None); without one it becomes
    `no_draft` (None: an error). proposer(target, draft, spec, verify_cost) -> the proposer (None: plain decoding).
    calibrated: it needs the target's verify cost whatever the batch policy (adaptive width, tree budget)."""

    name: str
    summary: str
    proposer: Callable[[TargetModel, object, DecodeSpec, VerifyCost | None], Proposer | None]
    draft: str | None = None
    no_draft: str | None = None
    calibrated: Callable[[DecodeSpec], bool] = lambda spec: False
    adaptive_width: bool = False

    def method_for(self, draft) -> str:
        if self.draft is None:
            return self.name
        if draft is None:
            if self.no_draft is None:
                raise ValueError(f"method {self.name} needs a DFlash draft (--draft DIR)")
            return self.no_draft
        if isinstance(draft, EagleDraftModel):
            if self.name in ("dflash", "dflash-adaptive", "eagle"):
                return "eagle"
            raise ValueError(f"method {self.name} grows its candidates from a DFlash draft's block; this is an "
                             "EAGLE draft")
        if self.draft == "eagle":
            raise ValueError(f"method {self.name} needs an EAGLE draft, not a {type(draft).__name__}")
        return self.name


def _dflash(target, draft, spec, cost) -> DFlashProposer:
    return DFlashProposer(draft, target, spec.block_size, spec.denoise_steps, draft_weights=spec.draft_weights)


def _tree(lookup: bool, with_draft: bool):
    def build(target, draft, spec, cost) -> TreeProposer:
        chain = DFlashProposer(draft, target, spec.block_size, draft_weights=spec.draft_weights) if with_draft \
            else None
        return TreeProposer(chain, lookup=lookup, budget=spec.tree_budget,
                            verify_cost=cost if spec.tree_budget is None else None)

    return build


def _pld(target, draft, spec, cost) -> PromptLookupProposer:
    return PromptLookupProposer(max_ngram=spec.pld_max_ngram, num_pred=spec.pld_num_pred, block_size=spec.block_size)


def _eagle(target, draft, spec, cost) -> EagleProposer:
    return EagleProposer(draft, target, spec.block_size - 1)


def _budget_chosen(spec: DecodeSpec) -> bool:
    return spec.tree_budget is None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", "plain autoregressive decoding (no draft): the baseline", lambda *a: None),
    Method("dflash", "the DFlash draft's top-1 chain, a full block per step", _dflash, draft="dflash",
           no_draft="ar"),
    Method("dflash-adaptive", "the DFlash chain, its width chosen per step from measured costs", _dflash,
           draft="dflash", no_draft="ar", calibrated=lambda spec: True, adaptive_width=True),
    Method("dflash-tree", "a tree of the DFlash draft's best branches per step", _tree(False, True),
           draft="dflash", calibrated=_budget_chosen),
    Method("dflash+lookup", "the DFlash tree plus prompt-lookup branches", _tree(True, True), draft="dflash",
           no_draft="lookup-tree", calibrated=_budget_chosen),
    Method("lookup-tree", "prompt-lookup branches as a tree (no draft)", _tree(True, False),
           calibrated=_budget_chosen),
    Method("pld", "prompt-lookup decoding (n-gram continuations, no draft)", _pld),
    Method("eagle", "an EAGLE-3 drafter's chain", _eagle, draft="eagle"),
)}


def build_engine(target: TargetModel, draft: DFlashDraftModel | EagleDraftModel | None, spec: DecodeSpec, *,
                 verify_cost: VerifyCost | None = None, **engine_kw) -> Engine:
    """The engine that decodes `spec` on this target with this draft (a loaded draft model, or None).
    verify_cost: the target's calibration when the method or the batch policy needs one (default: the cached one
    of this target and machine, measured now if there is none or if spec.recalibrate). engine_kw: the engine's
    batching settings and tokenizer (`Engine`)."""
    spec = spec.resolved(target, draft)
    entry = spec.entry
    needs_cost = entry.calibrated(spec) or (spec.batch_policy == "measured" and spec.method != "ar")
    if needs_cost and verify_cost is None:
        # calibrate the verify as it will run: the proposer's taps included
        taps = () if draft is None or entry.draft is None else (
            draft.context_layer_ids if isinstance(draft, DFlashDraftModel) else tuple(draft.config.target_layer_ids))
        verify_cost = load_or_measure(target, refresh=spec.recalibrate, taps=taps)
    proposer = entry.proposer(target, draft, spec, verify_cost)
    engine = Engine(target, proposer, width_cost=verify_cost if entry.adaptive_width else None,
                    batch_cost=verify_cost if spec.batch_policy == "measured" else None, **engine_kw)
    engine.spec = spec
    log.info("decoding: %s", spec)
    return engine
