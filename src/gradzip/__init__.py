"""gradzip: gradient compression for data-parallel PyTorch training on commodity networks.

>>> import gradzip
>>> state = gradzip.register(ddp_model, "maxmin", bits=4)     # one line for DDP
>>> comm = gradzip.Communicator("topk", ratio=0.01)           # or explicit calls
>>> avg = comm.allreduce(tensor, name="fc.weight")
"""
from . import codecs, collectives, memory
from .codecs import Codec, Payload, codec
from .communicator import Communicator
from .config import Config
from .ddp import GradzipState, gradzip_hook, register
from .errors import CheckpointError, CommunicationError, GradzipError, SettingsMismatchError

__version__ = "0.1.0"

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
    "gradzip_hook",
    "memory",
    "register",
    "SettingsMismatchError",
]
