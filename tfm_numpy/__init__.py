"""tfm_numpy: the Transformer in pure NumPy, every layer with a hand-written backward. Never imports torch."""

from .attention import *  # noqa: F403
from .bert import *  # noqa: F403
from .checkpoint import *  # noqa: F403
from .classify import *  # noqa: F403
from .decoding import *  # noqa: F403
from .dpo import *  # noqa: F403
from .encoder_decoder import *  # noqa: F403
from .flash import *  # noqa: F403
from .functional import *  # noqa: F403
from .gpt import *  # noqa: F403
from .gradcheck import *  # noqa: F403
from .kv_cache import *  # noqa: F403
from .layers import *  # noqa: F403
from .lora import *  # noqa: F403
from .loss import *  # noqa: F403
from .masks import *  # noqa: F403
from .model_parallel import *  # noqa: F403
from .modern import *  # noqa: F403
from .module import Module as Module
from .module import ModuleList as ModuleList
from .module import Parameter as Parameter
from .moe import *  # noqa: F403
from .optim import *  # noqa: F403
from .parallel import *  # noqa: F403
from .positional import *  # noqa: F403
from .quantize import *  # noqa: F403
from .speculative import *  # noqa: F403
from .sublayers import *  # noqa: F403
from .swin import *  # noqa: F403
from .train import *  # noqa: F403
from .transformer import *  # noqa: F403
from .vit import *  # noqa: F403

__version__ = "0.1.0"
