"""The transport layer: a C engine over TCP behind a small Python API."""

from kvlink.transport.batch import Batch
from kvlink.transport.config import EngineConfig
from kvlink.transport.engine import PROTOCOL_VERSION, Engine, Peer
from kvlink.transport.region import Access, Region

__all__ = ["Access", "Batch", "Engine", "EngineConfig", "PROTOCOL_VERSION", "Peer", "Region"]
