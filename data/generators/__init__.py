"""Procedural datasets in the public schemas, so everything runs offline.

Each generator is `generate(n, seed, **options) -> list[dict]` returning rows
{"images": [{"bytes": PNG, "path": name}], "problem": "<image>...", "answer": "..."},
except the kinds in SCHEMAS, whose rows follow the schema given there.
"""

from data.generators import clevr, geo3k, zoom

GENERATORS = {"clevr": clevr.generate, "geo3k": geo3k.generate, "zoom": zoom.generate, "zoom_sft": zoom.generate_sft}
# Kinds whose rows have their own parquet schema (zoom: DeepEyes-47k's; zoom_sft: `messages` rows).
SCHEMAS = {"zoom": zoom.SCHEMA, "zoom_sft": zoom.SFT_SCHEMA}
