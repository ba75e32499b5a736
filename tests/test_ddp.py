"""DDP on CPU with the gloo backend: 2 processes with batch b each train exactly like 1 process with batch 2b
(same samples, same anchors, gradients averaged), so their final drafts agree."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from blockdraft.models.target import TargetModel
from blockdraft.train.config import TrainConfig
from blockdraft.train.trainer import train
from conftest import MASK_ID, tiny_llama


def _records(target: TargetModel) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 90, (6, 8), generator=g)
    out = target.hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24,
                             min_new_tokens=24, do_sample=False, pad_token_id=0)
    return [{"id": str(i), "input_ids": r.tolist(), "loss_mask": [0] * 8 + [1] * 24} for i, r in enumerate(out)]


def _cfg(out: str, batch: int) -> TrainConfig:
    return TrainConfig(out_dir=out, num_layers=1, block_size=4, num_target_features=2, mask_token_id=MASK_ID,
                       anchors=6, lr=1e-3, seqs_per_step=batch, steps=3, save_every=100, precision="fp32",
                       init="random", draft_vocab_size=0, warmup=1, min_lr_ratio=0.0)


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        target = TargetModel(tiny_llama(seed=3, init=0.05))
        train(_cfg(out, batch=1), target=target, records=_records(target), progress=False)
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_one_process_with_double_batch(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path / "ddp")), nprocs=2, join=True)
    target = TargetModel(tiny_llama(seed=3, init=0.05))
    train(_cfg(str(tmp_path / "single"), batch=2), target=target, records=_records(target), progress=False)
    from safetensors.torch import load_file

    ckpt = "checkpoints/step-0000003/draft.safetensors"  # fp32 weights (the exported draft is bf16)
    a, b = load_file(str(tmp_path / "ddp" / ckpt)), load_file(str(tmp_path / "single" / ckpt))
    assert a.keys() == b.keys()
    moved = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved < 1e-5, moved
    # and the weights did move (so the comparison means something)
    from blockdraft.train.trainer import make_draft

    start = make_draft(_cfg("unused", 2), target).state_dict()
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4
