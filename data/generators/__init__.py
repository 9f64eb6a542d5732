"""Procedural datasets in the public schemas, so everything runs offline.

Each generator is `generate(n, seed, **options) -> list[dict]` returning rows
{"images": [{"bytes": PNG, "path": name}], "problem": "<image>...", "answer": "..."}.
"""

from data.generators import clevr, geo3k

GENERATORS = {"clevr": clevr.generate, "geo3k": geo3k.generate}
