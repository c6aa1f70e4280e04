"""bench_peers.py's worker for Hugging Face transformers (PyTorch CPU): ``AutoModelForCausalLM.generate``, static
batches of ``slots`` prompts (left padded), each batch running until its last row is done."""

from __future__ import annotations

import os
import time

import protocol

protocol.claim_stdout()


class Worker:
    def setup(self, policy: str, configs: list[dict] | None = None, max_seq_len: int = 0,
              torch_threads: int | None = None, **_) -> dict:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        torch.set_num_threads(torch_threads or os.cpu_count() or 1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id
        self.eos_ids = tuple(eos if isinstance(eos, list) else [eos])
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else self.eos_ids[0]
        return {"seconds": time.perf_counter() - t0, "version": transformers.__version__,
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}

    def _batch(self, prompts: list[list[int]]):
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    def generate(self, prompts: list[list[int]], slots: int, eos: bool, max_new: int, seed: int,
                 greedy: bool = False, return_tokens: bool = False) -> dict:
        torch = self.torch
        responses = []
        t0 = time.perf_counter()
        for b in range(0, len(prompts), slots):
            chunk = prompts[b: b + slots]
            ids, mask = self._batch(chunk)
            torch.manual_seed(seed * 100_003 + b)
            kwargs = dict(max_new_tokens=max_new, pad_token_id=self.pad_id, eos_token_id=list(self.eos_ids))
            if not eos:  # EOS ignored: the min-length processor masks it until max_new tokens
                kwargs["min_new_tokens"] = max_new
            if greedy:
                kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
            else:  # T = 1 with no truncation (generate's default top_k is 50)
                kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            for row in out[:, ids.shape[1]:].tolist():
                resp = protocol.eos_cut(row, self.eos_ids) if eos else row
                responses.append(resp)
        return protocol.generation_result(time.perf_counter() - t0, responses, max_new, eos, return_tokens)

    def first_tokens(self, prompts: list[list[int]], slots: int, eos: bool) -> dict:
        return self.generate(prompts[:slots], slots, eos, max_new=1, seed=0)

    def logits(self, prompts: list[list[int]]) -> dict:
        torch = self.torch
        with torch.inference_mode():
            return {"logits": [self.model(torch.tensor([p])).logits[0].double().tolist() for p in prompts]}


if __name__ == "__main__":
    w = Worker()
    protocol.serve({"setup": w.setup, "generate": w.generate, "first_tokens": w.first_tokens, "logits": w.logits})
