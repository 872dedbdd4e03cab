"""gradzip: gradient compression for data-parallel PyTorch training on commodity networks.

>>> import gradzip
>>> state = gradzip.register(ddp_model, "maxmin", bits=4)     # one line for DDP
>>> comm = gradzip.Communicator("topk", ratio=0.01)           # or explicit calls
>>> avg = comm.allreduce(tensor, name="fc.weight")
"""
from . import codecs, comm
from .sync import memory
from .codecs import Codec, Payload, codec
from .sync.engine import Communicator
from .config import Config
from .frontends.ddp import GradzipState, gradzip_hook, register
from .errors import CheckpointError, CommunicationError, GradzipError, SettingsMismatchError

from .version import __version__

collectives = comm  # the name this package had before the layered layout

__all__ = [
    "CheckpointError",
    "Codec",
    "CommunicationError",
    "Communicator",
    "Config",
    "GradzipError",
    "GradzipState",
    "Payload",
    "codec",
    "codecs",
    "collectives",
    "comm",
    "gradzip_hook",
    "memory",
    "register",
    "SettingsMismatchError",
]
