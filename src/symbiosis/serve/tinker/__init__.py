"""The Tinker training API of `symbiosis serve` (api.py), on hosted training (service.py)."""
