"""Bad input on the decode path: property-based tests, a fuzz target, garbage from RabbitMQ."""
