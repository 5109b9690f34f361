// Encodes texts with the reference GPT-2 encoder of the npm package gpt-3-encoder, for the
// golden tests of common/gpt2_tokenizer.h.
// Usage: node gpt2_reference_encode.js PACKAGE_DIR TEXTS_JSON OUT_JSON
// TEXTS_JSON holds a JSON array of strings; OUT_JSON receives a JSON array of id arrays.
'use strict';
const fs = require('fs');
const path = require('path');

const [packageDir, textsPath, outPath] = process.argv.slice(2);
const encoder = require(path.resolve(packageDir, 'Encoder.js'));
const texts = JSON.parse(fs.readFileSync(textsPath, 'utf-8'));
fs.writeFileSync(outPath, JSON.stringify(texts.map((t) => encoder.encode(t))));
