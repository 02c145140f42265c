"""Transport backends other than the native engine (see kvlink.transport.backend)."""
