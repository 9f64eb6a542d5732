"""Procedural datasets in the public schemas, so everything runs offline.

Each generator is `generate(n, seed, **options) -> list[dict]` returning rows
{"images": [{"bytes": PNG, "path": name}], "problem": "<image>...", "answer": "..."},
except the kinds in SCHEMAS, whose rows follow the schema given there, and those in
VIDEO_SCHEMAS, whose rows hold {"videos": [{"bytes": mp4, "path": name}]} in place of images.
"""

from data.generators import clevr, geo3k, video, zoom

GENERATORS = {"clevr": clevr.generate, "geo3k": geo3k.generate, "zoom": zoom.generate, "zoom_sft": zoom.generate_sft,
              "video": video.generate}
# Kinds whose rows hold videos rather than images: parquet in this schema, or JSONL with files beside it.
VIDEO_SCHEMAS = {"video": video.SCHEMA}
# Kinds whose rows have their own parquet schema (zoom: DeepEyes-47k's; zoom_sft: `messages` rows).
SCHEMAS = {"zoom": zoom.SCHEMA, "zoom_sft": zoom.SFT_SCHEMA}
