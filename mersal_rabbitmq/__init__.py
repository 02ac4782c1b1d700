"""The RabbitMQ transport for Mersal (aio-pika): `App(..., transport="amqp://...")`."""

from mersal_rabbitmq import patches
from mersal_rabbitmq.transport import (
    ConsumerLost,
    RabbitMQConsumer,
    RabbitMQDelivery,
    RabbitMQTransport,
)

patches.apply()

__all__ = ["ConsumerLost", "RabbitMQConsumer", "RabbitMQDelivery", "RabbitMQTransport"]
