"""The model runner's multimodal concern: M-RoPE positions for prompts with images, the
encoder run once per image (cached by hash until the scheduler drops it), and the
step's input embeddings with the image rows in place. A mixin of `ModelRunner`
(worker/model_runner.py), whose constructor sets the attributes it reads."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import SchedulerOutput


class MultimodalMixin:
    def _mm_rows(self):
        """Rows of this step whose chunk is still in a prompt with images:
        (row, state, first token of the chunk, end of the chunk)."""
        batch, step = self.input_batch, self.last_step
        for r in range(batch.num_reqs()):
            state = self.requests[batch.req_ids[r]]
            if not state.mm_features:
                continue
            end = int(step.seq_lens[r])
            start = end - int(step.query_start_loc[r + 1] - step.query_start_loc[r])
            if start < len(state.prompt_token_ids):
                yield r, state, start, end

    def _mrope_positions(self, positions: np.ndarray) -> np.ndarray:
        """M-RoPE ids [3, T]: a prompt with images reads its precomputed ones, every other
        token its index + its request's delta (the same id on all three axes). A step
        without image prompts (decodes) gets [T]: one id per token, the plain rotary's
        cheaper gather, the same cos / sin."""
        batch, step = self.input_batch, self.last_step
        n = batch.num_reqs()
        num_sched = np.diff(step.query_start_loc)
        delta = np.fromiter((self.requests[rid].mrope_delta for rid in batch.req_ids[:n]),
                            dtype=np.int64, count=n)
        flat = positions + np.repeat(delta, num_sched)
        rows = list(self._mm_rows())
        if not rows:
            return flat
        out = np.repeat(flat[None], 3, axis=0)
        for r, state, start, end in rows:
            end = min(end, len(state.prompt_token_ids))
            q = int(step.query_start_loc[r])
            out[:, q:q + end - start] = state.mrope_positions[:, start:end]
        return out

    def _encode(self, features) -> None:
        """Run the encoder once over these images (all of them in one call) and cache
        each one's output rows by its hash."""
        todo, seen = [], set()
        for f in features:
            if f.hash not in self.encoder_cache and f.hash not in seen:
                seen.add(f.hash)
                todo.append(f)
        if not todo:
            return
        dev = self.device
        pixels = torch.from_numpy(np.concatenate([f.pixel_values for f in todo])).to(dev)
        outs = self.model.encode_images(pixels, [tuple(f.image_grid_thw) for f in todo])
        for f, out in zip(todo, outs):
            if out.shape[0] != f.length:
                raise ValueError(f"image {f.hash[:12]}: the encoder gave {out.shape[0]} rows "
                                 f"for {f.length} placeholder tokens")
            self.encoder_cache[f.hash] = out
        self.num_encoded_images += len(todo)

    def _multimodal_embeds(self, so: SchedulerOutput, input_ids: torch.Tensor):
        """The step's input embeddings with the image rows in place, or None (no row of
        this step reads an image)."""
        scheduled = [self.requests[rid].mm_features[i]
                     for rid, idx in so.scheduled_encoder_inputs.items() for i in idx]
        rows = list(self._mm_rows())
        needed = []  # (flat index of the chunk's first overlapping token, feature, lo, hi)
        for r, state, start, end in rows:
            q = int(self.last_step.query_start_loc[r])
            for f in state.mm_features:
                lo, hi = max(start, f.offset), min(end, f.offset + f.length)
                if lo < hi:
                    needed.append((q + lo - start, f, lo - f.offset, hi - f.offset))
        # (an entry missing though not scheduled, after a failed step: encoded now)
        self._encode(scheduled + [f for _, f, _, _ in needed])
        if not needed:
            return None
        dev = self.device
        index = torch.from_numpy(np.concatenate(
            [first + self._arange_upto(hi - lo) for first, _, lo, hi in needed])).to(dev)
        embeds = torch.cat([self.encoder_cache[f.hash][lo:hi] for _, f, lo, hi in needed])
        return self.model.embed_multimodal(input_ids, index, embeds)
