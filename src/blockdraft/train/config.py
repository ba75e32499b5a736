"""The one training configuration: every option of `blockdraft train`, a recipe file's keys.

A run reads its targets from one of two sources:
- a teacher cache (`cache`, written once by `blockdraft teacher-cache`): the target never runs during training, the
  labels are its greedy tokens, the block mask is factorised (`blockattn.py`) -- the fast path on a CPU;
- training records (`data`): the target runs online (or features come from `blockdraft features`), one dense (or
  flex) block mask per sequence -- the path for GPUs, for EAGLE-3 and for the ablations that need raw records.
The loop around them (schedule, signals, checkpoints, resume, DDP) is the same (`trainer.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from ..decode.spec import dflash_method

INITS = ("target", "target-identity", "random")


@dataclass
class TrainConfig:
    # ---------------------------------------------------------------------------------------- where the targets are
    cache: str = ""  # teacher cache(s) of the training records, comma-separated (sequences drawn from their union)
    heldout_cache: str = ""  # teacher cache of held-out records (the learning curve; cache source)
    data: str = ""  # training records (JSONL shard directory or packed .npz) for the live source
    heldout: str = ""  # held-out records (live source: decoded with the engine for a held-out tau)
    features: str = "online"  # live source: "online" (the target runs per sequence) or a `blockdraft features` dir
    target: str | None = None  # the target model (the CLI's --target; a path, a hub id or an alias)
    out_dir: str = "runs/draft"
    # ---------------------------------------------------------------------------------------- the draft
    method: str = "dflash"  # "dflash" (block diffusion) or "eagle" (the EAGLE-3 baseline, live source, train/eagle.py)
    init: str = "target"  # "target" (copy the target's last layers), "target-identity" (the same with zeroed output
    #                        maps), "random", or a draft directory to continue
    num_layers: int = 2  # draft layers; a continued draft with fewer gets identity-initialised layers appended
    layer_ids: list[int] | None = None  # tapped target layers fed to the fusion (default: a continued draft's, else
    #                                     `num_target_features` spread over the target's depth)
    num_target_features: int = 2  # how many layers `layer_ids` spreads when unset
    block_size: int = 16  # the draft's block size (decoding may use any size up to it)
    intermediate_size: int = 0  # the draft layers' MLP width (0 = the target's); narrower, a layer copied from the
    #                              target keeps its most important MLP channels (`DFlashDraftModel.
    #                              init_layers_from_target`): a draft's bytes per step on a large target
    mask_token_id: int | None = None  # default: chosen from the target's tokenizer
    draft_vocab_size: int | None = None  # propose among the N most frequent response labels only (0 = the whole
    #                                     vocabulary; default 8192 for DFlash, the whole one for EAGLE)
    next_token_feature: bool = False  # the fusion also reads each context position's next-token embedding (a
    #                                   departure from the public layout: `DFlashConfig.next_token_feature`)
    next_token_scale: float = 1.0  # ... times this factor, when the input is added
    decode_block: int = 0  # the block the draft recommends decoding with, written into its config.json
    #                        (`decode_block_size`; 0 = none: decoders use block_size)
    decode_method: str = ""  # the decoding method the draft recommends (`--method auto`), written into its
    #                          config.json (`decode_method`; "" = none: decoders use dflash-adaptive)
    copy_gate: bool = False  # a learned bonus on prompt lookup's candidate (`copy_gate.py`; cache source)
    layer_mix: bool = False  # each draft layer mixes the fused inputs with its own learned weights (a departure from
    #                          the public layout: `DFlashConfig.layer_mix`; matters with 2+ draft layers only)
    # ---------------------------------------------------------------------------------------- what a step sees
    train_block: int = 0  # rows per training block (<= block_size; 0 = block_size): short blocks put more of each
    #                        step into the first positions, which decide acceptance most
    anchors: int = 0  # anchors per sequence; 0 = every valid response position
    anchor_bias: float = 0.0  # cache source, with `anchors`: draw anchor p with weight 1 + anchor_bias * (1 - the
    #                           target's probability of token p), so that tokens the target hesitated over start
    #                           more blocks; decoding starts every block after a token the draft missed, and those
    #                           are mostly such tokens (`batches.anchor_weights`)
    seqs_per_step: int = 4  # sequences per optimizer step (over all processes under torchrun)
    bucket: bool = True  # cache source: a step's sequences are neighbours in (anchors, length) order, so that
    #                      padding (anchor slots and context rows a shorter sequence leaves empty) nearly vanishes
    max_len: int = 512  # tokens per sequence (longer ones are cut)
    gamma: float | None = None  # loss weight exp(-(k-1)/gamma) of block row k (default: the paper's for block_size)
    no_loss_decay: bool = False  # ablation: every block row weighs the same
    kd_weight: float = 0.0  # cache source: 0 = cross-entropy on the target's greedy token; 1 = distillation on its
    #                         top-k only
    chain_labels: bool = True  # cache source: label block row k >= 2 only where the text between the anchor and that
    #                            row is what the target itself would have written (always so on target-written
    #                            records; on teacher-forced human text only those rows are what decoding verifies)
    target_labels: bool = False  # live source: label every row with the target's greedy token (teacher-forced)
    uniform_blocks: bool = False  # live source ablation: consecutive blocks instead of random anchors
    no_target_features: bool = False  # live source ablation: no conditioning on the target
    batched: bool = False  # live source: a step's sequences go through the target and the draft in one batched
    #                        forward (`live.batch_loss`; the GPU path) instead of one after another
    device: str = "cpu"  # where the target and the draft run ("cpu", "cuda", "cuda:1", ...)
    attention: str = "auto"  # live source: "sdpa" (dense bool mask), "flex" (BlockMask), "auto" = flex on CUDA
    loss_chunk_rows: int = 512  # live source: rows per LM-head chunk of the loss
    ttt_steps: int = 3  # eagle: unrolled training-time-test steps after step 0 (EAGLE-3 uses 6; CPU budget: 3)
    # ---------------------------------------------------------------------------------------- optimisation
    steps: int = 1000
    minutes: float = 0.0  # stop after this much training time (0 = no limit); the schedule still uses `steps`
    lr: float = 6e-4
    warmup: int = 20  # linear warm-up steps, then a cosine down to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    copy_gate_lr: float = 1e-2  # the gate table's own (constant after warm-up) learning rate: its bonuses must reach
    #                             a few nats, and Adam moves a weight by about its lr per step
    mix_lr_scale: float = 10.0  # the layer mix's weights learn at this multiple of lr: a handful of scalars that
    #                             must move by O(1), where Adam moves a weight by about its lr per step
    seed: int = 0
    precision: str = "auto"  # "bf16" autocast, "fp32", or "auto": bf16 only where the CPU multiplies it natively
    threads: int = 0  # torch threads (0 = torch's default)
    # ---------------------------------------------------------------------------------------- logs, curve, saving
    log_every: int = 10  # steps between train_log.jsonl entries
    eval_every: int = 50  # steps between curve.jsonl entries (held-out evaluation; 0 = only at the start and end)
    eval_seqs: int = 64  # cache source: held-out sequences scored per evaluation
    eval_anchors: int = 32  # ... anchors per held-out sequence (seeded, fixed for the whole run)
    eval_block: int = 0  # rows per evaluated block (0 = block_size); the implied tau covers decode blocks up to it
    walk_seqs: int = 16  # held-out sequences decoded by a teacher-forced walk (`walk_tau`; 0 = off)
    walk_block: int = 4  # the decode block of that walk (the default draft decodes with 4)
    eval_prompts: int = 8  # live source: held-out prompts decoded with the engine per evaluation
    eval_max_new_tokens: int = 64
    save_every: int = 100  # steps between checkpoints
    keep_last: int = 3  # checkpoints kept

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "TrainConfig":
        """A recipe file (YAML, TrainConfig field names) with `overrides` (not None) on top; unknown names raise."""
        import yaml

        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a recipe is a mapping of TrainConfig fields, got {type(raw).__name__}")
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown training options {sorted(unknown)}")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**raw)

    @property
    def source(self) -> str:
        """"cache" (teacher caches) or "live" (records; the target runs, or offline features are read)."""
        return "cache" if self.cache else "live"

    def __post_init__(self) -> None:
        if self.cache and self.data:
            raise ValueError("give either cache (teacher caches) or data (training records), not both")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")
        if self.train_block == 0:
            self.train_block = self.block_size
        if not 2 <= self.train_block <= self.block_size:
            raise ValueError(f"train_block must be in 2..block_size ({self.block_size}), got {self.train_block}")
        if self.eval_block == 0:
            self.eval_block = self.block_size
        if not 2 <= self.eval_block <= self.block_size:
            raise ValueError(f"eval_block must be in 2..block_size ({self.block_size}), got {self.eval_block}")
        if self.decode_block and not 2 <= self.decode_block <= self.block_size:
            raise ValueError(f"decode_block must be 0 or in 2..block_size ({self.block_size}), got {self.decode_block}")
        if self.decode_method:
            self.decode_method = dflash_method(self.decode_method)  # checked when the config is made, not at the end
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError("kd_weight must be in [0, 1]")
        if not (self.anchor_bias >= 0.0 and math.isfinite(self.anchor_bias)):
            raise ValueError(f"anchor_bias must be a finite number >= 0, got {self.anchor_bias}")
        if not (self.mix_lr_scale > 0 and math.isfinite(self.mix_lr_scale)):
            raise ValueError(f"mix_lr_scale must be a finite number > 0, got {self.mix_lr_scale}")
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0 (0: the target's), got {self.intermediate_size}")
        if self.seqs_per_step < 1 or self.steps < 1:
            raise ValueError("seqs_per_step and steps must be >= 1")
        if self.method not in ("dflash", "eagle"):
            raise ValueError(f"method must be dflash or eagle, got {self.method!r}")
        if self.attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"attention must be auto, sdpa or flex, got {self.attention!r}")
        if self.source == "cache":
            live_only = [n for n in ("target_labels", "uniform_blocks", "no_target_features") if getattr(self, n)]
            if self.method != "dflash" or live_only:
                what = live_only or [f"method {self.method}"]
                raise ValueError(f"{', '.join(what)}: trains from records (data=...), not from a teacher cache")
        else:
            cache_only = [n for n in ("copy_gate", "next_token_feature", "anchor_bias") if getattr(self, n)]
            if cache_only or self.kd_weight:
                raise ValueError(f"{', '.join(cache_only or ['kd_weight'])}: trains from a teacher cache (cache=...)")
            if self.train_block != self.block_size and self.method != "dflash":
                raise ValueError("train_block < block_size trains a DFlash draft (method dflash)")
        if self.batched and (self.source == "cache" or self.method != "dflash" or self.target_labels):
            raise ValueError("batched trains a DFlash draft from records (data=...) with the records' own labels "
                             "(not with a teacher cache, method eagle or target_labels)")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = 0 if self.method == "eagle" else 8192
        if self.method == "eagle":
            if self.ttt_steps < 0:
                raise ValueError(f"ttt_steps must be >= 0, got {self.ttt_steps}")
            if self.draft_vocab_size or self.no_target_features:
                raise ValueError("method eagle supports neither no_target_features nor a reduced draft_vocab_size")


def load_train_config(path: str | Path | None, **overrides) -> TrainConfig:
    """The config of a run: a recipe file with `overrides` (not None) on top, or the overrides alone; refused
    without training data (a teacher cache or records)."""
    cfg = (TrainConfig.from_yaml(path, **overrides) if path
           else TrainConfig(**{k: v for k, v in overrides.items() if v is not None}))
    if not cfg.cache and not cfg.data:
        raise ValueError("no training data: pass --cache DIR (a teacher cache, with --heldout-cache) or --data DIR "
                         "(records), or set one of them in the --config file")
    return cfg


def parse_bool(text: str) -> bool:
    """A command-line boolean (TrainConfig's bool fields): true/false, yes/no, on/off, 1/0."""
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")
