"""A local three-node RabbitMQ cluster for the tests that need one (`make cluster-test`)."""
