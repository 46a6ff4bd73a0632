"""Shipped model directories, as package data: default/ is the model `foreshock serve` loads when given
no --model (foreshock.predictor.registry.default_model_path); default/REPRODUCE.md says how it was built."""
