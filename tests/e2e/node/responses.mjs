// The openai Node SDK against llmgw's Responses API: create, stream, and a function call's
// output sent back. Prints one JSON line of what it saw; the Python test judges it.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.LLMGW_URL + "/v1", apiKey: process.env.LLMGW_KEY, maxRetries: 0 });
const model = process.env.LLMGW_MODEL;

const created = await client.responses.create({ model, instructions: "Be brief.", input: "hello", max_output_tokens: 8 });

// Random weights seldom stop by themselves, so the stream may end incomplete at
// max_output_tokens, as OpenAI's does; its last lifecycle event carries the response.
const kinds = [];
let streamed;
const stream = client.responses.stream({ model, input: "hello again", max_output_tokens: 8 });
for await (const event of stream) {
  kinds.push(event.type);
  if (event.response) streamed = event.response;
}
const textOf = (r) =>
  r.output
    .filter((item) => item.type === "message")
    .flatMap((item) => item.content)
    .filter((part) => part.type === "output_text")
    .map((part) => part.text)
    .join("");

const answered = await client.responses.create({
  model,
  max_output_tokens: 8,
  tools: [{ type: "function", name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } } } }],
  input: [
    { role: "user", content: "weather in Paris?" },
    { type: "function_call", call_id: "call_1", name: "get_weather", arguments: '{"city":"Paris"}' },
    { type: "function_call_output", call_id: "call_1", output: "sunny, 21 C" },
  ],
});

console.log(
  JSON.stringify({
    created: { status: created.status, text: created.output_text, usage: created.usage },
    streamed: { status: streamed.status, text: textOf(streamed), usage: streamed.usage, kinds },
    answered: { status: answered.status, text: answered.output_text, usage: answered.usage },
  }),
);
