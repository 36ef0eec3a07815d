"""HMI's domains and tenant models on `symbiosis serve` (PLOT tables for the lower layers, adapters on the upper)."""
