"""The RabbitMQ transport for Mersal (aio-pika): `App(..., transport="amqp://...")`."""

from mersal_rabbitmq.consuming import ConsumerLost, RabbitMQConsumer, RabbitMQDelivery
from mersal_rabbitmq.transport import RabbitMQTransport

__all__ = ["ConsumerLost", "RabbitMQConsumer", "RabbitMQDelivery", "RabbitMQTransport"]
