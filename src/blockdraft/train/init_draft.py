"""`blockdraft init-draft`: a randomly initialised DFlash draft for a target, its last layers copied from the target's
(`DFlashDraftModel.init_from_target`): the starting point of training, or a speed baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.draft import DFlashDraftModel
from ..models.draft_config import DFlashConfig
from ..models.loading import default_mask_token_id, load_target


@dataclass(frozen=True)
class InitDraftConfig:
    """out: the draft directory written; layers: draft layers; num_target_features: tapped target layers (None: the
    default spread); mask_token_id: None picks one from the target's tokenizer; seed: the random initialisation's."""

    out: str
    target: str | None = None
    layers: int = 3
    block_size: int = 16
    num_target_features: int | None = None
    mask_token_id: int | None = None
    seed: int = 0


def init_draft(cfg: InitDraftConfig) -> DFlashConfig:
    """Write the draft to cfg.out; returns its config."""
    target, _ = load_target(cfg.target, "fp32", weights="bf16")
    torch.manual_seed(cfg.seed)
    dcfg = DFlashConfig.from_target(
        target.config, num_hidden_layers=cfg.layers, block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id if cfg.mask_token_id is not None
        else default_mask_token_id(target.tokenizer, target.vocab_size),
        num_target_features=cfg.num_target_features)
    DFlashDraftModel(dcfg).init_from_target(target).save_pretrained(cfg.out)
    return dcfg
