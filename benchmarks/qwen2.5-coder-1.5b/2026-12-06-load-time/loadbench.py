"""Load the 1.5B for decoding with the GGUF reader and row check of commit eb1f48b ('before', patched in) or the
working tree's ('after'), in one process per load, alternated."""
import subprocess, sys, time
which = sys.argv[1] if len(sys.argv) > 1 else None
if which is None:
    for i in range(3):
        for w in ("before", "after"):
            subprocess.run([sys.executable, __file__, w])
    sys.exit()
import torch
torch.set_num_threads(2)
import blockdraft.models.quant.plan as plan
if which == "before":
    src = subprocess.run(["git", "-C", "/work/main", "show", "eb1f48b:src/blockdraft/models/quant/gguf.py"],
                         capture_output=True, text=True, check=True).stdout
    src = src.replace("from .formats import", "from blockdraft.models.quant.formats import")
    old = {}
    exec(compile(src, "old_gguf.py", "exec"), old)
    plan.GGUFBlocks, plan.match_rows = old["GGUFBlocks"], old["match_rows"]
from blockdraft.models.loading import load_target
t0 = time.time()
target, _ = load_target("qwen2.5-coder-1.5b", "bf16", decode_only=True)
print(which, round(time.time() - t0, 1), "s", target.weights.describe()["quantized"], flush=True)
