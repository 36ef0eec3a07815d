"""What a model directory holds and which part of it each side owns."""
