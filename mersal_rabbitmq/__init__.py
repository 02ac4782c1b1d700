"""The RabbitMQ transport for Mersal (aio-pika): `App(..., transport="amqp://...")`."""

from mersal_rabbitmq.transport import (
    ConsumerLost,
    RabbitMQConsumer,
    RabbitMQDelivery,
    RabbitMQTransport,
)

__all__ = ["ConsumerLost", "RabbitMQConsumer", "RabbitMQDelivery", "RabbitMQTransport"]
