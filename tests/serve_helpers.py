"""A real `python -m blockdraft.cli serve` process on a free loopback port over a tiny random model, for the server's
tests (test_serve*.py). The target is a tiny random LLaMA saved with the real SmolLM2 tokenizer (as in test_cli), the
draft a tiny untrained DFlash draft."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


from conftest import seeded

API_KEY = "sk-test-123"


def tiny_model_dir(out: Path) -> tuple[Path, Path]:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from blockdraft.models.draft import DFlashDraftModel
    from blockdraft.models.draft_config import DFlashConfig
    from blockdraft.models.loading import materialize, resolve_target
    from blockdraft.models.target import TargetModel

    tok = AutoTokenizer.from_pretrained(materialize(resolve_target(None)))
    # initializer_range 0.5: a random tiny model with HF's 0.02 emits "\n" forever, poor material for stop strings
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=24, intermediate_size=37, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      initializer_range=0.5, eos_token_id=tok.eos_token_id, bos_token_id=1, tie_word_embeddings=True)
    with seeded(0):
        model = LlamaForCausalLM(cfg)
    target_dir, draft_dir = out / "tiny-llama", out / "tiny-draft"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    dcfg = DFlashConfig.from_target(cfg, num_hidden_layers=1, block_size=4, mask_token_id=16, num_target_features=2)
    with seeded(1):
        draft = DFlashDraftModel(dcfg)
    draft.init_from_target(TargetModel(model, tok)).save_pretrained(draft_dir)
    return target_dir, draft_dir


class Server:
    """A `python -m blockdraft.cli serve` process; its output goes to a log file (no pipe to fill up)."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 120.0) -> None:
        self.log_path = log_path
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "blockdraft.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", "--threads", "1", *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        self.port = None
        while time.time() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text())
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        if self.port is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + log_path.read_text()[-3000:])
        while time.time() < deadline:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server never became healthy:\n" + log_path.read_text()[-3000:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = API_KEY, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        """-> (status, headers dict (lower-case names), parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            h = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=h)
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                payload = json.loads(text)
            except json.JSONDecodeError:
                payload = text
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload
        finally:
            conn.close()

    def post(self, path: str, body=None, auth: bool = True, **kw):
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        return self.request("POST", path, body, headers=headers, **kw)

    def get(self, path: str):
        return self.request("GET", path, headers={"Authorization": f"Bearer {API_KEY}"})

    def health(self) -> dict:
        return self.get("/health")[2]

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.time() + timeout
        while True:
            h = self.health()
            if h["active"] == 0 and h["queued"] == 0:
                return h
            if time.time() > deadline:
                raise AssertionError(f"server not idle: {h}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
