-- The dashboard's export page lists who downloaded the export and when.
CREATE INDEX audit_log_by_export ON audit_log (export_id, id) WHERE export_id IS NOT NULL;
