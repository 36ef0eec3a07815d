"""What a tenant runs: its model skeleton, virtual base layers, and everything it owns."""
