"""The AMQP 1.0 transport: `amqp10://` and `amqps10://` URLs, proton's engine on asyncio."""

from mersal_amqp10.transport import Amqp10Transport

__all__ = ["Amqp10Transport"]
