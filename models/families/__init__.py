"""The model families, one module each; importing one registers it (`models.family.register`)."""

from models.families import qwen_vl  # noqa: F401
from models.families import llava  # noqa: F401
from models.families import idefics3  # noqa: F401
from models.families import gemma3  # noqa: F401
from models.families import glm4v  # noqa: F401
from models.families import internvl  # noqa: F401
from models.families import qwen3_5  # noqa: F401
from models.families import gemma4  # noqa: F401
