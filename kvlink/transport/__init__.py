"""The transport layer: a C engine over TCP behind a small Python API."""

from kvlink.transport.backend import Backend, Capabilities, Unsupported
from kvlink.transport.batch import Batch
from kvlink.transport.config import EngineConfig
from kvlink.transport.engine import PROTOCOL_VERSION, Engine, Peer
from kvlink.transport.region import Access, Region

__all__ = ["Access", "Backend", "Batch", "Capabilities", "Engine", "EngineConfig", "PROTOCOL_VERSION", "Peer",
           "Region", "Unsupported"]
