"""Images in a prompt -> the features the engine carries (front end, off the engine
thread, like tokenization).

`MultiModalProcessor` (built for a checkpoint whose config names an image token)
runs the checkpoint's own HF image processor (AutoImageProcessor, saved beside it)
on each image, giving its patches [N, C*T*P*P] and grid (t, h, w); expands each
image placeholder token of the prompt into one token per encoder output row
(t * h * w / merge^2); and hashes each image's patches and grid, the key of the
encoder cache and of the prefix cache's blocks over its placeholders.
"""
from __future__ import annotations

import hashlib
import threading

import numpy as np

from tokenmill.core.sched_output import MultiModalFeature
from tokenmill.errors import ParamError

FIELD = "multi_modal_data.image"


def is_multimodal(hf_config: dict) -> bool:
    """Whether the checkpoint's model class takes images (a vision-language checkpoint
    served as its text model, as Qwen3.5's under tensor parallelism, does not)."""
    if hf_config.get("image_token_id") is None or \
            not isinstance(hf_config.get("vision_config"), dict):
        return False
    from tokenmill.models.registry import resolve_model_class
    try:
        return hasattr(resolve_model_class(hf_config), "encode_images")
    except ValueError:
        return False


def _as_array(image, index: int, max_pixels: int) -> np.ndarray:
    """A PIL image or an array [H, W, 3] / [H, W] -> an RGB uint8-or-float array."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL
        w, h = image.size
        if w * h > max_pixels:
            raise ParamError(FIELD, f"{FIELD}[{index}]: {w}x{h} pixels is more than "
                                    f"max_image_pixels={max_pixels}")
        return np.asarray(image.convert("RGB"))
    if not isinstance(image, np.ndarray):
        raise ParamError(FIELD, f"{FIELD}[{index}]: expected a PIL image or a numpy array, "
                                f"got {type(image).__name__}")
    arr = image
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4) or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ParamError(FIELD, f"{FIELD}[{index}]: an array image must be [H, W, 3] "
                                f"(or [H, W], [H, W, 4]), got shape {list(image.shape)}")
    if arr.shape[0] * arr.shape[1] > max_pixels:
        raise ParamError(FIELD, f"{FIELD}[{index}]: {arr.shape[1]}x{arr.shape[0]} pixels is "
                                f"more than max_image_pixels={max_pixels}")
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.number) or not np.isfinite(arr).all():
            raise ParamError(FIELD, f"{FIELD}[{index}]: pixel values must be finite numbers")
        if arr.min() < 0 or arr.max() > 255:
            raise ParamError(FIELD, f"{FIELD}[{index}]: pixel values must be in [0, 255]")
        arr = arr.astype(np.uint8)
    return np.ascontiguousarray(arr[:, :, :3])


class MultiModalProcessor:
    def __init__(self, model_dir: str, hf_config: dict):
        self.model_dir = model_dir
        self.image_token_id = int(hf_config["image_token_id"])
        self.merge = int(hf_config["vision_config"].get("spatial_merge_size", 1))
        self._image_processor = None
        self._lock = threading.Lock()

    @property
    def image_processor(self):
        with self._lock:  # (built once, on the first image)
            if self._image_processor is None:
                from transformers import AutoImageProcessor
                try:
                    self._image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
                except Exception as e:  # noqa: BLE001 - many ways to lack one
                    raise ValueError(f"{self.model_dir} has no usable image processor "
                                     f"(preprocessor_config.json): {e}") from e
            return self._image_processor

    def process(self, prompt_ids: list[int], images, limits) -> tuple[list[int],
                                                                      list[MultiModalFeature]]:
        """(prompt ids with each image placeholder expanded, one feature per image)."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            return list(prompt_ids), []
        if len(images) > limits.max_images_per_request:
            raise ParamError(FIELD, f"{FIELD}: {len(images)} images is more than "
                                    f"max_images_per_request={limits.max_images_per_request}")
        ids = np.asarray(prompt_ids, dtype=np.int64)
        where = np.nonzero(ids == self.image_token_id)[0]
        if where.size != len(images):
            raise ParamError(FIELD, f"{FIELD}: {len(images)} image(s) given but the prompt has "
                                    f"{where.size} image placeholder token(s) "
                                    f"(id {self.image_token_id})")
        arrays = [_as_array(img, i, limits.max_image_pixels) for i, img in enumerate(images)]
        feats, pieces, prev, grown = [], [], 0, 0
        for i, (arr, pos) in enumerate(zip(arrays, where.tolist())):
            try:
                out = self.image_processor(images=[arr], return_tensors="np")
            except ParamError:
                raise
            except ValueError as e:
                raise ParamError(FIELD, f"{FIELD}[{i}]: the image processor refused it: {e}")
            pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
            grid = [int(v) for v in np.asarray(out["image_grid_thw"]).reshape(-1)[:3]]
            length = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            h = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes())
            h.update(pixels.tobytes())
            pieces.append(ids[prev:pos])
            pieces.append(np.full(length, self.image_token_id, dtype=np.int64))
            feats.append(MultiModalFeature(h.hexdigest(), pixels, grid, pos + grown, length))
            grown += length - 1
            prev = pos + 1
        pieces.append(ids[prev:])
        return np.concatenate(pieces).tolist(), feats
