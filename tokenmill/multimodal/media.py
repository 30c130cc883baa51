"""Images named in chat messages (OpenAI content parts) -> decoded images.

Only what is in the request or on this machine where the operator allowed it:
`data:` URLs (base64) always; `file://` paths only inside the folder given by
`--allowed-local-media-path`; nothing is fetched from the network (an http(s)
URL is a 400). Every image is checked against the request limits before it is
decoded (encoded bytes: max_image_bytes; pixels, read from the header:
max_image_pixels), and anything that does not decode is a ParamError naming the
part it came from.
"""
from __future__ import annotations

import base64
import binascii
import io
import os

from tokenmill.errors import ParamError

IMAGE_PART_TYPES = ("image_url", "image", "image_pil")


def _decode(raw: bytes, field: str, limits):
    from PIL import Image, UnidentifiedImageError
    if len(raw) > limits.max_image_bytes:
        raise ParamError(field, f"{field}: the image is {len(raw)} bytes, more than "
                                f"max_image_bytes={limits.max_image_bytes}")
    try:
        img = Image.open(io.BytesIO(raw))
        w, h = img.size  # (from the header: nothing decoded yet)
        if w * h > limits.max_image_pixels:
            raise ParamError(field, f"{field}: the image is {w}x{h} pixels, more than "
                                    f"max_image_pixels={limits.max_image_pixels}")
        img.load()
        return img.convert("RGB")
    except ParamError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as e:
        raise ParamError(field, f"{field}: cannot decode the image ({type(e).__name__})")


def load_image_url(url, field: str, limits, allowed_local_media_path: str | None = None):
    """An image_url's url -> a PIL image (RGB)."""
    if not isinstance(url, str):
        raise ParamError(field, f"{field}: url must be a string")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise ParamError(field, f"{field}: a data URL must be data:<type>;base64,<data>")
        # (base64 is 4 characters per 3 bytes: refuse an oversized one before decoding)
        if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
            raise ParamError(field, f"{field}: the image is more than "
                                    f"max_image_bytes={limits.max_image_bytes} bytes")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ParamError(field, f"{field}: the data URL is not valid base64")
        return _decode(raw, field, limits)
    if url.startswith("file://"):
        if not allowed_local_media_path:
            raise ParamError(field, f"{field}: file:// URLs are not allowed on this server "
                                    f"(see --allowed-local-media-path)")
        root = os.path.realpath(allowed_local_media_path)
        path = os.path.realpath(url[len("file://"):])
        if os.path.commonpath([root, path]) != root:
            raise ParamError(field, f"{field}: the file is outside the allowed media folder")
        if not os.path.isfile(path):
            raise ParamError(field, f"{field}: no such file in the allowed media folder")
        if os.path.getsize(path) > limits.max_image_bytes:
            raise ParamError(field, f"{field}: the image is more than "
                                    f"max_image_bytes={limits.max_image_bytes} bytes")
        with open(path, "rb") as f:
            return _decode(f.read(), field, limits)
    if url.startswith(("http://", "https://")):
        raise ParamError(field, f"{field}: remote image URLs are not fetched by this server; "
                                f"send the image as a data: URL (base64)")
    raise ParamError(field, f"{field}: unsupported image URL (data: or file:// only)")


def extract_images(messages, limits, allowed_local_media_path: str | None = None) -> list:
    """The images of a conversation's content parts, in order (the order the chat
    template emits their placeholders in)."""
    images = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else getattr(msg, "content", None)
        if not isinstance(content, (list, tuple)):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                part = part.model_dump() if hasattr(part, "model_dump") else part
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
                continue
            field = f"messages[{i}].content[{j}].{part['type']}"
            if len(images) >= limits.max_images_per_request:
                raise ParamError(field, f"{field}: more than max_images_per_request="
                                        f"{limits.max_images_per_request} images")
            if part["type"] == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(load_image_url(url, field, limits, allowed_local_media_path))
            else:  # an image object already (offline chat): a PIL image or an array
                img = part.get(part["type"])
                if img is None:
                    raise ParamError(field, f"{field}: the part holds no image")
                images.append(img)
    return images
