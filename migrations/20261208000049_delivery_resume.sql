-- Deliveries count every byte they send and resume from what is already in the partner's bucket.
--
-- `bytes_sent`: the bytes pushed into the bucket over every attempt, each file counted against
-- the tenant's egress quota before it is sent (a file sent again is counted again). It replaces
-- the flag that counted the export once, however many times it was pushed.
ALTER TABLE bucket_deliveries ADD COLUMN bytes_sent bigint NOT NULL DEFAULT 0;
UPDATE bucket_deliveries SET bytes_sent = bytes_done;
ALTER TABLE bucket_deliveries DROP COLUMN egress_counted;

-- Each file a delivery completed in the bucket, as the bucket reported it right after: a later
-- attempt (a retry, or a retry by hand) skips the files still there with this size and ETag and
-- sends the rest.
CREATE TABLE bucket_delivery_files (
    delivery_id uuid    NOT NULL REFERENCES bucket_deliveries (id) ON DELETE CASCADE,
    ordinal     integer NOT NULL,
    bytes       bigint  NOT NULL,
    e_tag       text,
    CONSTRAINT bucket_delivery_files_pkey PRIMARY KEY (delivery_id, ordinal)
);
