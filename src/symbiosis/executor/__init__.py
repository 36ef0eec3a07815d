"""The base executor: frozen base layers held once, served to many clients."""
