"""The driver: configs, Ray cluster and placement, launch, validation, aggregation."""
