"""OpenAI's files and fine-tuning jobs API of `symbiosis serve` (api.py), on the service's hosted training (service.py)."""
