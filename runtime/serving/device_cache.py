"""The serving engine's device cache: runtime/device_cache.py (moved there so generation can use it too)."""

from tessera.runtime.device_cache import DeviceCache, session_device  # noqa: F401  (re-exported)
