-- What `mersal db upgrade --sql --outbox-table billing_outbox --inbox-table billing_inbox` printed for PostgreSQL before the version table
-- was keyed on the pair of tables (commit 433034a): a database that release migrated.
BEGIN;

CREATE TABLE billing_outbox_alembic_version (
    version_num VARCHAR(32) NOT NULL, 
    CONSTRAINT billing_outbox_alembic_version_pkc PRIMARY KEY (version_num)
);

-- Running upgrade  -> mersal_0001

CREATE TABLE billing_outbox (
    id BIGSERIAL NOT NULL, 
    app VARCHAR(200) NOT NULL, 
    address TEXT NOT NULL, 
    publish BOOLEAN NOT NULL, 
    headers TEXT NOT NULL, 
    body BYTEA NOT NULL, 
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
    lease_until TIMESTAMP WITH TIME ZONE, 
    attempts INTEGER DEFAULT 0 NOT NULL, 
    parked_reason TEXT, 
    parked_at TIMESTAMP WITH TIME ZONE, 
    PRIMARY KEY (id)
);

CREATE INDEX ix_billing_outbox_claim ON billing_outbox (app, id) WHERE parked_at IS NULL;

CREATE TABLE billing_inbox (
    app VARCHAR(200) NOT NULL, 
    message_id VARCHAR(255) NOT NULL, 
    handled_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
    PRIMARY KEY (app, message_id)
);

CREATE INDEX ix_billing_inbox_handled_at ON billing_inbox (handled_at);

INSERT INTO billing_outbox_alembic_version (version_num) VALUES ('mersal_0001') RETURNING billing_outbox_alembic_version.version_num;

COMMIT;

