"""A FastAPI front end and a `mersal run` worker sharing one PostgreSQL database over RabbitMQ.

The web layer (`web.py`) runs a send-only App whose outbox uses the web layer's own engine: an
endpoint writes an order and sends `PlaceOrder` in one database transaction. The worker
(`worker.py`) bills the order through a repository built on the message's session.

    export MERSAL_TRANSPORT=amqp://guest:guest@127.0.0.1/
    export MERSAL_DATABASE=postgresql+asyncpg://postgres@127.0.0.1/shop
    python -m examples.fastapi_orders.schema         # mersal db upgrade + the shop's tables
    mersal run examples.fastapi_orders.worker:create_app
    uvicorn --factory examples.fastapi_orders.web:create_api
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \
         -d '{"order_id": "o-1", "amount": 9.5}'
    curl localhost:8000/orders/o-1                   # "status": "billed" once the worker ran

It needs `pip install -e '.[examples]'` in the checkout (FastAPI, uvicorn, the RabbitMQ and SQL
adapters).
"""
