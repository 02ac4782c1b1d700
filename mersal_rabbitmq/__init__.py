"""The RabbitMQ transport for Mersal (aio-pika): `App(..., transport="amqp://...")`."""

from mersal_rabbitmq.transport import (
    ConsumerLost,
    RabbitMQConsumer,
    RabbitMQDelivery,
    RabbitMQTransport,
    tolerate_text_that_is_not_utf8,
)

tolerate_text_that_is_not_utf8()

__all__ = ["ConsumerLost", "RabbitMQConsumer", "RabbitMQDelivery", "RabbitMQTransport"]
