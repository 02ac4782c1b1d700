"""The shop of docs/tutorial.md: an orders web service and a billing worker.

The orders service (`web.py`) is a FastAPI app whose Mersal app also consumes:
it takes orders over HTTP, publishes `OrderPlaced`, and runs the payment saga
(`sagas.py`), which asks billing to charge the order and cancels it when no
payment comes in time. The billing worker (`billing.py`) charges orders and
refunds late payments.

    pip install -e '.[examples]'
    export MERSAL_TRANSPORT=amqp://guest:guest@127.0.0.1/
    export MERSAL_DATABASE=postgresql+asyncpg://postgres@127.0.0.1/shop
    mersal db upgrade && python -m examples.shop.db
    mersal run examples.shop.billing:create_app
    uvicorn --factory examples.shop.web:create_api
"""
