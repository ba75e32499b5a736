"""One way to say how to decode (`DecodeSpec`), one registry of methods, and the one builder of engines.

Every caller (the CLI's generate and chat, the server, the benchmark, regeneration of training data, held-out
evaluation during training) builds its engine with `build_engine(target, draft, spec)`; the method names below are
the one vocabulary of the CLI (`--method`), the server (`--method`) and the benchmark (`--methods`), and each entry
states what callers need to know of it (its draft, chain or tree, calibrated, default block). The benchmark's
references outside the engine (Hugging Face, llama.cpp) are named once too, in `REFERENCES`.

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

`auto` (the CLI's default) is not a method but a choice among them: the one the DFlash draft's config.json
recommends (`decode_method`, written where the draft was measured), else `dflash-adaptive`.
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
from .proposers.record import FeatureRecorder
from .proposers.tree import TreeProposer

log = logging.getLogger(__name__)

PLD_BLOCK_SIZE = 16  # prompt lookup's default block: it drafts as far as a copy goes, verification is the limit
DRAFT_WEIGHTS = ("auto", "bf16", "int8", "int4")
BATCH_POLICIES = ("always", "measured")
ALIASES = {"none": "ar", "plain": "ar", "lookup": "pld", "prompt-lookup": "pld", "fixed-width": "dflash",
           "adaptive": "dflash-adaptive", "tree": "dflash-tree", "tree-lookup": "dflash+lookup"}
AUTO = "auto"  # the draft's recommended method (its config's decode_method), else AUTO_FALLBACK
AUTO_FALLBACK = "dflash-adaptive"


@dataclass(frozen=True)
class DecodeSpec:
    """How to decode: a method of the registry (or `AUTO`: the draft's recommended one) and its settings, checked
    when made.

    block_size: tokens per verify step (None: the draft's recommended decode block size, else its trained size;
    PLD_BLOCK_SIZE for prompt lookup; an EAGLE draft's own chain length + 1), resolved once by `resolved`;
    denoise_steps: DFlash refinement passes per block; tree_budget: nodes per candidate tree (None: chosen per step
    from the verify-cost calibration); draft_weights: the fused draft's weights (auto: 8-bit when the target runs
    on quantized weights, where the draft reads as many bytes per step as a good share of the target, else bf16;
    int4 halves the bytes again, at some cost in how often its proposals are accepted);
    batch_policy: with several rows, `measured` drafts only in steps where the calibration says it pays (policy.py),
    `always` drafts every step; recalibrate: measure the verify cost again instead of reading the cached one;
    pld_max_ngram / pld_num_pred: prompt lookup's longest n-gram and tokens per proposal (None: the block);
    record_layers / record_topk: plain decoding (`ar` only) that also keeps the tapped features of these target
    layers and the top-k logits at every position (`proposers.record.FeatureRecorder`: teacher data written in the
    same pass as the answers)."""

    method: str = "dflash"
    block_size: int | None = None
    denoise_steps: int = 1
    tree_budget: int | None = None
    draft_weights: str = "auto"
    batch_policy: str = "always"
    recalibrate: bool = False
    pld_max_ngram: int = 3
    pld_num_pred: int | None = None
    record_layers: tuple[int, ...] = ()
    record_topk: int = 16

    def __post_init__(self) -> None:
        name = ALIASES.get(self.method, self.method)
        if name not in METHODS and name != AUTO:
            raise ValueError(f"unknown decoding method {self.method!r}; choose one of {', '.join(METHODS)}, {AUTO} "
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
        if self.record_layers and name != "ar":
            raise ValueError(f"recording teacher data runs plain decoding (method ar), not {name}")
        if self.record_topk < 1:
            raise ValueError(f"record_topk must be >= 1, got {self.record_topk}")
        object.__setattr__(self, "record_layers", tuple(int(i) for i in self.record_layers))

    @property
    def entry(self) -> "Method":
        """The registry entry; for `AUTO` before a draft is known, the fallback's (every method `AUTO` can become
        decodes with a DFlash draft)."""
        return METHODS[AUTO_FALLBACK if self.method == AUTO else self.method]

    def resolved(self, target: TargetModel, draft) -> "DecodeSpec":
        """This spec for this target and draft: the method the draft allows (`AUTO`: the draft's recommendation;
        an EAGLE draft decodes `eagle`; a method whose draft is missing falls back as its registry entry says), the
        block size and the draft's weights made concrete."""
        method = (recommended_method(draft) if self.method == AUTO else self.entry).method_for(draft)
        entry, bs = METHODS[method], self.block_size
        if entry.draft == "dflash":
            bs = decode_block_size(draft, bs)
        elif entry.draft == "eagle":
            bs = bs or draft.config.max_draft_steps + 1
        elif entry.default_block is not None:
            bs = bs or entry.default_block
        else:
            bs = 1
        weights = self.draft_weights
        if weights == "auto":
            weights = "int8" if getattr(getattr(target, "weights", None), "mode", "bf16") != "bf16" else "bf16"
        return dataclasses.replace(self, method=method, block_size=bs, draft_weights=weights)


@dataclass(frozen=True)
class Method:
    """A registry entry, and what every caller asks of a method instead of listing names.

    draft: the draft it decodes with ("dflash", "eagle" or None); without one it becomes `no_draft` (None: an
    error). proposer(target, draft, spec, verify_cost) -> the proposer (None: plain decoding). calibrated: it needs
    the target's verify cost whatever the batch policy (adaptive width, tree budget). adaptive_width: the engine
    chooses its chain's width per step. tree: its candidates form a tree of branches (else a chain).
    default_block: its block where neither the user nor a draft sets one (None: a draft's, or 1 without drafting).
    drafts: it proposes tokens, so its steps report acceptance per drafted position. bench_default: in the
    benchmark's default methods. weights_rerun: the benchmark reruns it for every extra `--weights` mode."""

    name: str
    summary: str
    proposer: Callable[[TargetModel, object, DecodeSpec, VerifyCost | None], Proposer | None]
    draft: str | None = None
    no_draft: str | None = None
    calibrated: Callable[[DecodeSpec], bool] = lambda spec: False
    adaptive_width: bool = False
    tree: bool = False
    default_block: int | None = None
    drafts: bool = True
    bench_default: bool = False
    weights_rerun: bool = True

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


def dflash_method(name: str) -> str:
    """The registry name of a method that decodes with a DFlash draft (an alias resolved): what a draft may
    recommend (`decode_method`); anything else is a ValueError naming the choices."""
    entry = METHODS.get(ALIASES.get(name, name))
    if entry is None or entry.draft != "dflash":
        raise ValueError(f"decode_method {name!r} is not a DFlash method (one of "
                         f"{', '.join(m for m, e in METHODS.items() if e.draft == 'dflash')})")
    return entry.name


def recommended_method(draft) -> Method:
    """The registry entry `AUTO` decodes with for this draft: a DFlash draft's `decode_method`, else
    AUTO_FALLBACK. A recommendation that names no DFlash method is refused, not ignored: the draft was saved by a
    different version or edited by hand, and decoding with another method than it says would measure something
    else than its model card."""
    name = draft.config.decode_method if isinstance(draft, DFlashDraftModel) else None
    if name is None:
        return METHODS[AUTO_FALLBACK]
    try:
        return METHODS[dflash_method(name)]
    except ValueError as e:
        raise ValueError(f"the draft's config.json: {e}; pass --method") from None


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
    Method("ar", "plain autoregressive decoding (no draft): the baseline", lambda *a: None, drafts=False,
           bench_default=True),
    Method("dflash", "the DFlash draft's top-1 chain, a full block per step", _dflash, draft="dflash",
           no_draft="ar", bench_default=True),
    Method("dflash-adaptive", "the DFlash chain, its width chosen per step from measured costs", _dflash,
           draft="dflash", no_draft="ar", calibrated=lambda spec: True, adaptive_width=True),
    Method("dflash-tree", "a tree of the DFlash draft's best branches per step", _tree(False, True),
           draft="dflash", calibrated=_budget_chosen, tree=True),
    Method("dflash+lookup", "the DFlash tree plus prompt-lookup branches", _tree(True, True), draft="dflash",
           no_draft="lookup-tree", calibrated=_budget_chosen, tree=True),
    Method("lookup-tree", "prompt-lookup branches as a tree (no draft)", _tree(True, False),
           calibrated=_budget_chosen, tree=True, default_block=PLD_BLOCK_SIZE, weights_rerun=False),
    Method("pld", "prompt-lookup decoding (n-gram continuations, no draft)", _pld, default_block=PLD_BLOCK_SIZE,
           bench_default=True),
    Method("eagle", "an EAGLE-3 drafter's chain", _eagle, draft="eagle", bench_default=True, weights_rerun=False),
)}


@dataclass(frozen=True)
class Reference:
    """A method the benchmark runs outside this registry's engines, for comparison (data only: the benchmark
    builds its runner).

    runner: "engine-hf" (the registry method `engine_method` on the target's Hugging Face modules and dynamic
    cache), "hf" (transformers' `generate`), "llamacpp" (llama.cpp through its Python bindings) or
    "llamacpp-server" (llama.cpp's own server). greedy_only: it runs at temperature 0 only. own_file: on the
    target's own GGUF (else its bf16 export). draft: "dflash" (our draft exported to GGUF, llama.cpp's DFlash),
    "family" (a smaller model of the target's family as llama.cpp's draft model), "lookup" (prompt lookup) or None.
    plain: the plain reference on the same weights whose greedy output it is compared with. plain_llamacpp:
    llama.cpp's plain decoding of the target's file, what the report compares our methods against."""

    name: str
    summary: str
    runner: str
    engine_method: str | None = None
    greedy_only: bool = False
    own_file: bool = True
    draft: str | None = None
    plain: str | None = None
    plain_llamacpp: bool = False
    bench_default: bool = False


REFERENCES: dict[str, Reference] = {r.name: r for r in (
    Reference("ar-hf", "ar on the target's Hugging Face modules", "engine-hf", engine_method="ar"),
    Reference("dflash-hf", "dflash on the target's Hugging Face modules", "engine-hf", engine_method="dflash"),
    Reference("hf", "transformers generate, plain", "hf"),
    Reference("hf-pld", "transformers generate with prompt lookup", "hf", greedy_only=True, draft="lookup",
              bench_default=True),
    Reference("llamacpp", "llama.cpp's Python bindings, plain", "llamacpp", plain_llamacpp=True),
    Reference("llamacpp-pld", "llama.cpp's Python bindings with prompt lookup", "llamacpp", greedy_only=True,
              draft="lookup"),
    Reference("llamacpp-bf16", "llama.cpp's Python bindings on the bf16 export", "llamacpp", own_file=False),
    Reference("llamacpp-server", "llama-server, plain", "llamacpp-server", greedy_only=True, plain_llamacpp=True),
    Reference("llamacpp-server-bf16", "llama-server on the bf16 export", "llamacpp-server", greedy_only=True,
              own_file=False),
    Reference("llamacpp-dflash", "llama-server with our DFlash draft", "llamacpp-server", greedy_only=True,
              draft="dflash", plain="llamacpp"),
    Reference("llamacpp-dflash-bf16", "llama-server with our DFlash draft on the bf16 export", "llamacpp-server",
              greedy_only=True, own_file=False, draft="dflash", plain="llamacpp-bf16"),
    Reference("llamacpp-spec", "llama-server with a smaller model of the family as draft model, its defaults",
              "llamacpp-server", greedy_only=True, draft="family", plain="llamacpp-server"),
    Reference("llamacpp-spec-n", "llama-server with a smaller model of the family as draft model, "
              "--llamacpp-spec-n drafted tokens", "llamacpp-server", greedy_only=True, draft="family",
              plain="llamacpp-server"),
)}


def registry_entry(name: str) -> Method | None:
    """The registry entry a benchmark method name decodes with: a method (`dflash`), its weights variant
    (`dflash@int8`) or its Hugging Face variant (`dflash-hf`); None for the other references."""
    base = name.split("@", 1)[0]
    ref = REFERENCES.get(base)
    return METHODS.get(ref.engine_method if ref is not None else base)


def proposer_taps(draft, method: str) -> tuple[int, ...]:
    """The target layers whose features `method`'s proposer reads at every verify with this draft: what a
    verify-cost calibration must tap to time the verify as it runs."""
    if draft is None or METHODS[method].draft is None:
        return ()
    return tuple(draft.context_layer_ids if isinstance(draft, DFlashDraftModel) else draft.config.target_layer_ids)


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
        verify_cost = load_or_measure(target, refresh=spec.recalibrate, taps=proposer_taps(draft, spec.method))
    proposer = (FeatureRecorder(spec.record_layers, spec.record_topk) if spec.record_layers else
                entry.proposer(target, draft, spec, verify_cost))
    engine = Engine(target, proposer, width_cost=verify_cost if entry.adaptive_width else None,
                    batch_cost=verify_cost if spec.batch_policy == "measured" else None, **engine_kw)
    engine.spec = spec
    log.info("decoding: %s", spec)
    return engine
