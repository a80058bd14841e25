"""A probe that crashes the way a broken native driver does (run as a child by a test)."""

import ctypes

ctypes.string_at(0)
