"""The RabbitMQ transport for Mersal (aio-pika)."""
