"""Free loopback ports for the real parts the tests start (one implementation, in the library)."""

from stream.broker import free_port, free_port_pair

__all__ = ["free_port", "free_port_pair"]
